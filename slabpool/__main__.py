"""`python -m slabpool ...` is the `slabpool` command."""

from slabpool.engine.job.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
