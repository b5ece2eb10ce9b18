"""`python -m ninfer_rt.serve`: the same command as `ninfer-rt serve`."""

from ninfer_rt.serve.command import serve

serve(prog_name="python -m ninfer_rt.serve")
