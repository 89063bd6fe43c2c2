"""python -m tests.contract: see tests/contract/__init__.py."""
import sys

from tests.contract.run import main

sys.exit(main())
