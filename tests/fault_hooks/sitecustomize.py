"""Test-only: Python imports this at start-up in processes whose PYTHONPATH names this folder.

``tests/kv_faults.corrupt_kv_env`` sets that up for a ``kvship local`` process
tree; the hook then patches the prefill KV managers (see ``kv_faults``).
"""

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kv_faults  # noqa: E402

kv_faults.install_from_env()
