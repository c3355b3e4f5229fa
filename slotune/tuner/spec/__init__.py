"""What the user writes, validated once at load.

- `tuning_spec.TuningSpec`: the spec file; `sections`: ObjectiveSpec, Budget, Cost, EarlyStop,
  Sweep, Screening; `workload_spec.WorkloadSpec`: a workload's shape.
- `slo`: SLOLimits and `judge`, the one SLO verdict (trials, report, operator canary).
- `traces` / `trace_reader.load_trace`: trace files (recorded, Mooncake, Azure, BurstGPT).
- `yaml_reader`: the one reader of user YAML, `SpecError` with `field: message` problems.
- `preflight`: checks that need the file system or the model, before a study starts.

Submodules are imported directly (`from slotune.tuner.spec.tuning_spec import TuningSpec`), so
importing one part never loads the others.
"""
