"""`python -m ninfer_rt.serve`: the same command as `ninfer-rt serve` (its flags are defined with the CLI's)."""

from ninfer_rt.cli.serve import serve

serve(prog_name="python -m ninfer_rt.serve")
