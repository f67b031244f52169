"""What the Ansible test modules share: where the playbooks are, and running ansible's tools
from this interpreter's venv with a fixed environment."""
from __future__ import annotations

import os
import re
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


RECAP = re.compile(r"^(\S+)\s*:\s*ok=\d+\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)


def failures(output: str) -> str:
    """Each failed task of a playbook's output with its TASK header, so a CI log that keeps only
    the head of a long assertion still shows why it failed."""
    task, out = "", []
    for line in output.splitlines():
        if line.startswith("TASK ["):
            task = line
        elif line.startswith(("fatal:", "failed:")) or "FAILED!" in line:
            out.extend([task, line[:2000]])
    return "\n".join(out) or "(none reported)"


def recap(output: str) -> dict[str, tuple[int, int, int]]:
    """PLAY RECAP: host -> (changed, unreachable, failed)."""
    tail = output[output.rindex("PLAY RECAP"):]
    return {m[1]: (int(m[2]), int(m[3]), int(m[4])) for m in RECAP.finditer(tail)}


def role_tasks_play(path: Path, hosts: str, role: str, tasks_from: str, what: str) -> Path:
    """Write a one-task play running `tasks_from` of one of this repo's roles on `hosts` (a
    role's part tried alone), and return its path."""
    path.write_text(f"""---
- name: {what}
  hosts: {hosts}
  gather_facts: false
  tasks:
    - name: Run {tasks_from} of role {role}
      ansible.builtin.include_role:
        name: {ANSIBLE_DIR / "roles" / role}
        tasks_from: {tasks_from}
""")
    return path
