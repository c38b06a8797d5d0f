"""`python -m alpamayo_ros.serve` = `alpamayo-serve`."""

import sys

from .cli import main

sys.exit(main())
