"""``python -m pipeline``. Run by a Python without the project's dependencies (not the venv that ``make setup``
made), it says so in one line instead of an import traceback."""
import sys

try:
    from pipeline.cli import main
except ModuleNotFoundError as exc:  # hydra, omegaconf, rich...: not installed for this Python
    if (exc.name or "").split(".")[0] == "pipeline":
        raise
    print(f"error: {exc.name} is not installed for {sys.executable}: run the project's environment "
          f"(`source .venv/bin/activate` after `make setup`, or `.venv/bin/python -m pipeline ...`)", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    main()
