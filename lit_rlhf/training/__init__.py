"""Lightning glue: `RLHFModule` (hooks and the update loop), resume state, atomic checkpoints, LR schedules
and metrics."""
