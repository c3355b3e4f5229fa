"""The tuner: a workload SLO in, a measured winner out.

Data flows one way through its subpackages, and each imports only its own layer or an earlier one
(tests/engine_tests/test_layering.py):

    spec -> workload -> measure -> search -> decide -> report, tracking -> run, commands, sweep, cli

`tune run` is `run.run_command`; ARCHITECTURE.md maps every concept to its module.
"""
