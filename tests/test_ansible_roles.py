"""The Ansible roles without a deployment: ansible-lint's production profile, every bookie
config key as a role variable, the systemd units verified, the debian_packages role.

Reference: docs/api.md section 9 and issue 9 item 2. Apart from test_ansible.py (the deployment)
so that these run on another test worker while that module's playbooks run.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from bookkeeper.config import BookieConfig
from tests.ansible_tools import ANSIBLE_DIR, ansible_env, tool

pytestmark = [pytest.mark.slow, pytest.mark.runtime(60)]


def test_ansible_lint_production_profile_is_clean() -> None:
    """ansible-lint with the production profile (ansible/.ansible-lint) finds nothing."""
    lint = subprocess.run([tool("ansible-lint")], cwd=ANSIBLE_DIR, capture_output=True, text=True,
                          timeout=300, env=ansible_env(), stdin=subprocess.DEVNULL)
    assert lint.returncode == 0, lint.stdout[-5000:] + lint.stderr[-5000:]
    assert "Profile 'production' was required, and it passed" in lint.stdout + lint.stderr


def test_every_bookie_config_key_has_a_role_variable() -> None:
    """Every key of the bookie's config (README's table, `BookieConfig`) is written by the role's
    bookie.toml template (vars/main.yml `bookie_config`, with its TOML type) from a variable
    `bookie_<key>` of defaults/main.yml (`bookie_id` for the key `bookie_id`)."""
    role = ANSIBLE_DIR / "roles" / "bookie"
    role_vars = yaml.safe_load((role / "vars" / "main.yml").read_text())
    defaults = yaml.safe_load((role / "defaults" / "main.yml").read_text())
    keys = {f.name for f in fields(BookieConfig)}
    assert set(role_vars["bookie_config"]) == keys
    assert set(role_vars["bookie_config_types"]) == keys
    missing = [key for key in keys if (key if key == "bookie_id" else f"bookie_{key}") not in defaults]
    assert not missing, missing


def test_systemd_units_verify(tmp_path: Path) -> None:
    """The zookeeper and bookie units, rendered from the roles' templates and defaults, pass
    `systemd-analyze verify` without a word (it also checks that ExecStart exists)."""
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing (Debian package systemd)"
    bk = tmp_path / "opt" / "venv" / "bin" / "bk"
    bk.parent.mkdir(parents=True)
    bk.write_text("#!/bin/sh\nexit 0\n")
    bk.chmod(0o755)
    (tmp_path / "zookeeper").mkdir()
    roles = ANSIBLE_DIR / "roles"
    play = tmp_path / "render.yml"
    play.write_text(f"""---
- name: Render the systemd units
  hosts: localhost
  gather_facts: false
  vars_files:
    - {roles}/zookeeper/defaults/main.yml
    - {roles}/zookeeper/vars/main.yml
    - {roles}/bookie/defaults/main.yml
  tasks:
    - name: Render the zookeeper unit
      ansible.builtin.template:
        src: {roles}/zookeeper/templates/zookeeper.service.j2
        dest: {tmp_path}/zookeeper.service
        mode: "0644"
    - name: Render the bookie unit
      ansible.builtin.template:
        src: {roles}/bookie/templates/bookie.service.j2
        dest: {tmp_path}/bookie.service
        mode: "0644"
""")
    render = subprocess.run(
        [tool("ansible-playbook"), "-i", "localhost,", "-c", "local",
         "-e", f"ansible_python_interpreter={sys.executable}", str(play), "-e", "zookeeper_id=1",
         "-e", f"zookeeper_data_dir={tmp_path}/zookeeper", "-e", f"bookie_install_dir={tmp_path}/opt",
         "-e", "bookie_id=10.0.0.1:3181"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=ansible_env(), stdin=subprocess.DEVNULL)
    assert render.returncode == 0, render.stdout[-5000:] + render.stderr[-3000:]
    for unit in ("zookeeper.service", "bookie.service"):
        text = (tmp_path / unit).read_text()
        assert "ExecStart=" in text and "{{" not in text, text
    verify = subprocess.run([analyze, "verify", str(tmp_path / "zookeeper.service"), str(tmp_path / "bookie.service")],
                            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert verify.returncode == 0 and not (verify.stdout + verify.stderr).strip(), verify.stdout + verify.stderr
    assert f"ExecStart={bk} bookie --conf /etc/bookkeeper/bookie.toml" in (tmp_path / "bookie.service").read_text()


def test_debian_packages_asks_apt_only_for_what_dpkg_lacks(tmp_path: Path) -> None:
    """The debian_packages role leaves apt alone when dpkg lists every package installed, and
    hands apt exactly the missing ones otherwise (an unknown name: apt fails naming it alone)."""
    play = tmp_path / "packages.yml"
    play.write_text(f"""---
- name: Packages
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Install the packages
      ansible.builtin.include_role:
        name: {ANSIBLE_DIR}/roles/debian_packages
      vars:
        debian_packages_names: "{{{{ wanted }}}}"
""")
    missing = "bookkeeper-py-no-such-package"

    def run(wanted: list[str], verbosity: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [tool("ansible-playbook"), "-i", "localhost,", "-c", "local", verbosity,
             "-e", f"ansible_python_interpreter={sys.executable}", "-e", json.dumps({"wanted": wanted}),
             str(play)], cwd=tmp_path, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
            # ansible-core 2.20+ leaves a result's `invocation` out unless asked (2.19 always has it)
            env={**ansible_env(), "ANSIBLE_INJECT_INVOCATION": "True"})

    present = run(["supervisor"], "-v")
    assert present.returncode == 0, present.stdout[-4000:] + present.stderr[-2000:]
    apt_task = present.stdout[present.stdout.index("Install the packages dpkg does not have]"):]
    assert apt_task.split("\n")[1].startswith("skipping: [localhost]"), apt_task[:500]

    # -vvv: a failed result is printed as JSON with the module's arguments (its invocation).
    absent = run(["supervisor", missing], "-vvv")
    assert absent.returncode != 0
    head = "fatal: [localhost]: FAILED! => "
    start = absent.stdout.index(head) + len(head)
    result = json.loads(absent.stdout[start:absent.stdout.index("\n}\n", start) + 2])
    assert result["invocation"]["module_args"]["name"] == [missing], result
    assert f"No package matching '{missing}'" in result["msg"], result
