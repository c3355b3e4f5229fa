"""The Optuna study: ask -> evaluate -> tell.

- `study.open_study`: storage, sampler, pruner, the spec fingerprint a resumed study must match.
- `objective.TrialObjective`: the callable Optuna runs per trial (sample, measure, store, score).
- `records.TrialRecord`: a trial's stored state, and the study's; the one module that reads and
  writes Optuna user attributes.
- `trials`: budget shares, ranking of feasible trials, a config proposed twice.
- `starts`: reference trials, search-space starts and their repairs, warm starts.
- `budget.TrialBudget`, `screening.ScreeningPruner`, `references` (default and naive configs).
"""
