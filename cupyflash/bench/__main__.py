"""``python -m cupyflash.bench``."""
import sys

from .run import main

sys.exit(main())
