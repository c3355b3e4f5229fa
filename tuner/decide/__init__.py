"""The winner, chosen on measurements taken beside the default on fresh workload seeds.

- `candidates.candidates`: who enters the round; `confirm.run_round` / `confirm_round`: the round
  measured and judged (`Confirmation`); `declare.run_declaration`: the winner's declared numbers;
  `aggregate`: several measurements of one config as one.
Decisions return data; report/ writes the sentences.
"""
