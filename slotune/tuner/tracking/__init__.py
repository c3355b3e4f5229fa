"""MLflow tracking: what a trial's and a study's runs hold (`values`), and the study callback that
logs them (`tracker`)."""

from slotune.tuner.tracking.tracker import MLflowTracker, tracking_summary

__all__ = ["MLflowTracker", "tracking_summary"]
