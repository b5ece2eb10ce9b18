"""`python -m ninfer_rt.serve`: the same command as `ninfer-rt serve` (its flags are defined with the CLI's)."""

from ninfer_rt.cli.serve import serve

if __name__ == "__main__":  # intake workers are spawned processes: importing this must not start a server
    serve(prog_name="python -m ninfer_rt.serve")
