"""`python -m services.engine`."""
import sys

from services.engine import isa

try:  # TOKENSERVE_CPU_ISA caps torch's kernels too; torch reads these when it loads
    isa.apply_to_torch()
except ValueError:
    pass  # main() reports it as a usage error

from services.engine.main import main  # noqa: E402 (after the environment is set)

sys.exit(main())
