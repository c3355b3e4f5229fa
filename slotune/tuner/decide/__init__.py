"""The winner, chosen on measurements taken beside the default on fresh workload seeds (`confirm`);
`aggregate`: several measurements of one config as one. Decisions return data; report/ writes the sentences.
"""
