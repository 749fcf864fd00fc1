"""`lit-rlhf check`: a preflight of a training config, one module per check family (run.py gathers them)."""
