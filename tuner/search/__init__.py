"""The Optuna study: ask -> evaluate -> tell.

- `study.open_study`: storage, sampler, pruner, the spec fingerprint a resumed study must match.
- `objective.TrialObjective`: the callable Optuna runs per trial (sample, measure, store, score).
- `trials`: a trial's stored state read back (measured, screened out, ranked, repeated).
- `starts`: reference trials, search-space starts and their repairs, warm starts.
- `budget.TrialBudget`, `screening.ScreeningPruner`, `references` (default and naive configs).
"""
