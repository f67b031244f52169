"""What the Ansible test modules share: where the playbooks are, and running ansible's tools
from this interpreter's venv with a fixed environment."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.conftest import REPO

ANSIBLE_DIR = REPO / "ansible"
VENV_BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """The path of ansible-playbook, ansible-lint, ... in this venv."""
    path = VENV_BIN / name
    assert path.exists(), f"{path} is missing: pip install -r requirements.txt (ansible-core, ansible-lint)"
    return str(path)


def ansible_env() -> dict[str, str]:
    """This environment with the venv first on PATH, no colours, no retry files, and an
    inventory source that does not parse failing the run (not read as an empty inventory)."""
    return {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "true", "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_RETRY_FILES_ENABLED": "false", "PYTHONUNBUFFERED": "1"}
