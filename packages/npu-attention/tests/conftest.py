"""Makes the shared test module ``npu_attention_cases`` importable (importlib import mode)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
