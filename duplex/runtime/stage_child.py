"""`python -m duplex.runtime.stage_child`: the process a `StageProcess` starts (duplex/runtime/stage_process.py)."""

from duplex.runtime.stage_process import run_child

if __name__ == "__main__":
    run_child()
