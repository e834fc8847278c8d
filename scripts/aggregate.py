"""Same as tools/aggregate.py (kept where operators look for helpers); see docs/megascan_aggregate.md."""

import os
import runpy

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "aggregate.py"),
               run_name="__main__")
