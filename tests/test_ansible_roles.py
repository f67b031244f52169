"""The Ansible roles without a deployment: ansible-lint's production profile, every bookie
config key as a role variable, the systemd units verified, the debian_packages role, the
secure defaults (and plain text only when asked), no_log on every task that touches a secret.

Reference: docs/api.md section 9, issue 9 item 2 and issue 23 item 6. Apart from test_ansible.py (the deployment)
so that these run on another test worker while that module's playbooks run.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from bookkeeper.config import BookieConfig
from tests.ansible_tools import ANSIBLE_DIR, ansible_env, role_tasks_play, tool

pytestmark = [pytest.mark.slow, pytest.mark.runtime(90)]


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


# Words in a task's arguments that mean it reads or writes a secret: a private key, the token
# signing keys, a token, the ZooKeeper password or credentials, bookie.toml (it holds zk_auth),
# bk's environment (the same), ZooKeeper's key store.
SECRET = re.compile(r"key_file|key\.pem|keys_file|token|zk_auth|password|bookie\.toml|bk-client|"
                    r"bk_environment|server\.pem|tls (ca|issue|server)")


def _tasks(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for item in items or []:
        yield item
        for section in ("block", "rescue", "always"):
            yield from _tasks(item.get(section, []))


def test_every_task_that_touches_a_secret_has_no_log() -> None:
    """Every task of the roles and playbooks whose arguments name a key, token, password or a
    file holding one has `no_log` (set, not false): a failure must not print a secret.
    Directory tasks (ansible.builtin.file) only make paths and modes, a set_fact of *_file names
    only paths, and an assert whose message has no template prints that message alone."""
    files = [*ANSIBLE_DIR.glob("roles/*/tasks/*.yml"), *ANSIBLE_DIR.glob("*.yml")]
    checked, missing = 0, []
    for path in files:
        doc = yaml.safe_load(path.read_text()) or []
        plays = doc if path.parent == ANSIBLE_DIR else [{"tasks": doc}]
        for play in plays:
            for task in _tasks(play.get("tasks", [])):
                facts = task.get("ansible.builtin.set_fact") or {}
                check = task.get("ansible.builtin.assert")
                if "block" in task or "ansible.builtin.file" in task or (
                        facts and all(name.endswith("_file") for name in facts)) or (
                        check and "{{" not in str(check.get("fail_msg", ""))):
                    continue
                args = {k: v for k, v in task.items() if k not in ("name", "no_log", "when", "register")}
                if SECRET.search(json.dumps(args)):
                    checked += 1
                    if task.get("no_log") in (None, False):
                        missing.append(f"{path.relative_to(ANSIBLE_DIR)}: {task.get('name')}")
    assert checked >= 15, checked  # the secret-handling tasks were found at all
    assert not missing, missing


def _render_trust(tmp_path: Path, *extra: str) -> tuple[dict[str, Any], str, str]:
    """bookie.toml, zoo.cfg and bk-client.env rendered from the roles' defaults and vars for a
    host of an inventory with one ZooKeeper server (10.0.0.11): (bookie.toml parsed, zoo.cfg, env)."""
    roles = ANSIBLE_DIR / "roles"
    tmp_path.mkdir()
    (tmp_path / "inventory.ini").write_text("[zookeeper]\nzk1 zookeeper_connect_address=10.0.0.11\n\n"
                                            "[bookies]\nlocalhost ansible_connection=local\n")
    play = tmp_path / "render.yml"
    templates = {"bookie.toml": "bookie/templates/bookie.toml.j2", "zoo.cfg": "zookeeper/templates/zoo.cfg.j2",
                 "bk-client.env": "bookie/templates/bk-client.env.j2"}
    tasks = "".join(f"""    - name: Render {name}
      ansible.builtin.template:
        src: {roles}/{src}
        dest: {tmp_path}/{name}
        mode: "0600"
""" for name, src in templates.items())
    play.write_text(f"""---
- name: Render the trust settings
  hosts: localhost
  gather_facts: false
  vars_files:
    - {roles}/zookeeper/defaults/main.yml
    - {roles}/zookeeper/vars/main.yml
    - {roles}/bookie/defaults/main.yml
    - {roles}/bookie/vars/main.yml
  tasks:
{tasks}""")
    render = subprocess.run(
        [tool("ansible-playbook"), "-i", str(tmp_path / "inventory.ini"), str(play),
         "-e", f"ansible_python_interpreter={sys.executable}", "-e", "zookeeper_id=1",
         "-e", "bookie_advertised_address=10.0.1.11", "-e", "pki_zk_auth=digest:bookkeeper:not-a-secret", *extra],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=ansible_env(), stdin=subprocess.DEVNULL)
    assert render.returncode == 0, render.stdout[-5000:] + render.stderr[-3000:]
    return (tomllib.loads((tmp_path / "bookie.toml").read_text()), (tmp_path / "zoo.cfg").read_text(),
            (tmp_path / "bk-client.env").read_text())


def test_secure_by_default_and_plain_text_only_when_the_inventory_says_so(tmp_path: Path) -> None:
    """With the roles' defaults a bookie requires TLS with its certificate, authenticates by
    token, checks roles, holds ZooKeeper credentials and reaches ZooKeeper on its TLS port,
    whose plain port serves 127.0.0.1 alone; bk on the host gets the CA, the admin token (a
    file, not its text) and the credentials. bk_insecure_plaintext=true leaves every trust key
    out and opens the plain port; one override (bookie_tls=optional) changes that key alone."""
    toml, zoo, env = _render_trust(tmp_path / "secure")
    trust = "/etc/bookkeeper/trust"
    assert {k: toml.get(k) for k in ("metadata_uri", "tls", "tls_cert_file", "tls_key_file", "tls_ca_file",
                                     "auth_provider", "auth_token_keys_file", "auth_token", "authz_file",
                                     "zk_auth", "password_seal_key_file")} == {
        "metadata_uri": "zk+tls://10.0.0.11:2281/ledgers", "tls": "require",
        "tls_cert_file": f"{trust}/bookie.pem", "tls_key_file": f"{trust}/bookie-key.pem",
        "tls_ca_file": f"{trust}/ca.pem", "auth_provider": "token",
        "auth_token_keys_file": f"{trust}/token_keys.toml", "auth_token": f"file:{trust}/bookie.token",
        "authz_file": f"{trust}/authz.toml", "zk_auth": f"file:{trust}/zk_auth",
        "password_seal_key_file": f"{trust}/seal_key.pem"}
    assert "tls_client_auth" not in toml
    zoo_lines = set(zoo.splitlines())
    assert {"clientPortAddress=127.0.0.1", "secureClientPort=2281", "secureClientPortAddress=0.0.0.0",
            "ssl.clientAuth=none", "ssl.protocol=TLSv1.3", "ssl.keyStore.type=PEM"} <= zoo_lines, zoo
    assert {"BK_TLS=require", f"BK_TLS_CA_FILE={trust}/ca.pem", "BK_AUTH_PROVIDER=token",
            f"BK_AUTH_TOKEN=file:{trust}/admin.token", f"BK_ZK_AUTH=file:{trust}/zk_auth",
            "BK_METADATA_URI=zk+tls://10.0.0.11:2281/ledgers"} <= set(env.splitlines()), env

    toml, zoo, env = _render_trust(tmp_path / "plain", "-e", "bk_insecure_plaintext=true")
    trust_keys = {f.name for f in fields(BookieConfig)
                  if f.name.startswith(("tls", "auth", "authz", "zk_auth", "password_seal"))}
    assert not trust_keys & set(toml), toml
    assert toml["metadata_uri"] == "zk://10.0.0.11:2181/ledgers"
    assert "clientPortAddress=0.0.0.0" in zoo.splitlines() and "secureClientPort" not in zoo, zoo
    assert not [line for line in env.splitlines() if line.startswith("BK_") and "METADATA_URI" not in line], env

    toml, _, env = _render_trust(tmp_path / "optional", "-e", "bookie_tls=optional")
    assert toml["tls"] == "optional" and toml["auth_provider"] == "token" and "BK_TLS=optional" in env.splitlines()


def _pki_run(tmp_path: Path, pki_dir: Path, *extra: str) -> str:
    """The pki role as site.yml runs it (the cluster material once, then each bookie's and the
    ZooKeeper server's certificate), for two bookies and one ZooKeeper server on this machine."""
    (tmp_path / "inventory.ini").write_text(
        "[zookeeper]\nzk1 zookeeper_connect_address=10.0.0.11\n\n[bookies]\nb1 bookie_id=10.0.1.11:3181\n"
        f"b2 bookie_id=10.0.1.12:3181\n\n[all:vars]\nansible_connection=local\npki_dir={pki_dir}\n"
        f"ansible_python_interpreter={sys.executable}\n")
    pki = ANSIBLE_DIR / "roles" / "pki"
    (tmp_path / "pki.yml").write_text(f"""---
- name: The cluster's material
  hosts: bookies:zookeeper
  gather_facts: false
  tasks:
    - name: Make it
      ansible.builtin.include_role:
        name: {pki}
- name: Each bookie's certificate
  hosts: bookies
  gather_facts: false
  tasks:
    - name: Issue it
      ansible.builtin.include_role:
        name: {pki}
        tasks_from: bookie.yml
      vars:
        pki_bookie_id: "{{{{ bookie_id }}}}"
        pki_hosts: ["{{{{ bookie_id.split(':')[0] }}}}"]
- name: The ZooKeeper server's certificate
  hosts: zookeeper
  gather_facts: false
  tasks:
    - name: Issue it
      ansible.builtin.include_role:
        name: {pki}
        tasks_from: server.yml
      vars:
        pki_hosts: ["{{{{ zookeeper_connect_address }}}}", "{{{{ inventory_hostname }}}}"]
""")
    run = subprocess.run([tool("ansible-playbook"), "-i", str(tmp_path / "inventory.ini"), str(tmp_path / "pki.yml"),
                          *extra], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=ansible_env(),
                         stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-3000:]
    return run.stdout


def test_pki_makes_the_material_once_with_private_modes(tmp_path: Path) -> None:
    """The pki role makes a CA, each bookie's certificate naming bookie://<bookie_id>, the ZooKeeper
    server's, token keys and three tokens that verify with them, the authz file, the seal key
    and a ZooKeeper password: the directory 0700, every secret 0600; a second run changes
    nothing. With the operator's CA (pki_ca_cert_file/pki_ca_key_file) and vault-style
    variables for the token key and the ZooKeeper password, those are used, not generated."""
    from cryptography import x509

    from bookkeeper.security.tokens import TokenKeys

    pki = tmp_path / "pki"
    first = _pki_run(tmp_path, pki)
    assert "changed=0" not in first.split("PLAY RECAP")[1].splitlines()[1], first[-800:]
    secrets = [pki / "ca" / "ca-key.pem", pki / "token_keys.toml", pki / "zk_password", pki / "seal_key.pem",
               *(pki / "tokens" / f"{name}.token" for name in ("admin", "client", "bookie")),
               *(pki / "hosts").glob("*/*-key.pem")]
    assert len(secrets) == 10 and all(p.stat().st_mode & 0o777 == 0o600 for p in secrets), \
        {str(p): oct(p.stat().st_mode & 0o777) for p in secrets}
    assert pki.stat().st_mode & 0o777 == 0o700
    keys = TokenKeys(str(pki / "token_keys.toml"))
    assert {name: keys.verify((pki / "tokens" / f"{name}.token").read_text().strip()).subject
            for name in ("admin", "client", "bookie")} == {"admin": "admin", "client": "client", "bookie": "bookie"}
    assert tomllib.loads((pki / "authz.toml").read_text())["principals"]["client"] == ["write", "read"]
    cert = x509.load_pem_x509_certificate((pki / "hosts" / "b2" / "bookie-10.0.1.12_3181.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == ["bookie://10.0.1.12:3181"]
    assert (pki / "hosts" / "zk1" / "server-10.0.0.11.pem").exists()
    before = {p: p.read_bytes() for p in pki.rglob("*") if p.is_file()}

    second = _pki_run(tmp_path, pki)
    assert all(" changed=0 " in line for line in second.split("PLAY RECAP")[1].splitlines()[1:4]), second[-800:]
    assert {p: p.read_bytes() for p in pki.rglob("*") if p.is_file()} == before

    theirs = tmp_path / "operator"
    _pki_run(tmp_path, theirs, "-e", f"pki_ca_cert_file={pki}/ca/ca.pem", "-e", f"pki_ca_key_file={pki}/ca/ca-key.pem",
             "-e", "pki_token_key=" + "QUJD" * 11, "-e", "pki_zk_password=from-the-vault")
    assert (theirs / "ca" / "ca.pem").read_bytes() == (pki / "ca" / "ca.pem").read_bytes()
    assert not (theirs / "zk_password").exists()
    assert 'k1 = "' + "QUJD" * 11 + '"' in (theirs / "token_keys.toml").read_text()
    assert TokenKeys(str(theirs / "token_keys.toml")).verify(
        (theirs / "tokens" / "admin.token").read_text().strip()).subject == "admin"


@pytest.mark.parametrize(("current", "switch", "refused"), [
    ("clientPort=2181\n", "false", True),                    # a plain quorum would be switched on
    ("clientPort=2181\nsslQuorum=true\n", "false", False),   # already on: nothing to switch
    ("clientPort=2181\n", "true", False),                    # the operator stopped every server
])
def test_the_zookeeper_role_refuses_to_switch_quorum_tls_one_server_at_a_time(
        tmp_path: Path, current: str, switch: str, refused: bool) -> None:
    """Found by review: a secure multi-server deployment made before quorum TLS existed would,
    on the next site.yml, restart its servers one at a time with sslQuorum on: the first
    could not talk to its plain peers and the play stopped with it out of the quorum. The role
    refuses before changing anything: its check (tasks/quorum_tls_switch.yml, the first thing
    tasks/main.yml runs after the variables' assert) against a server's current zoo.cfg."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "zoo.cfg").write_text(current)
    (tmp_path / "inventory.ini").write_text(
        "[zookeeper]\nzk1 zookeeper_id=1\nzk2 zookeeper_id=2\n\n[all:vars]\nansible_connection=local\n"
        f"ansible_python_interpreter={sys.executable}\nzookeeper_config_dir={conf}\nzookeeper_tls=true\n"
        f"zookeeper_quorum_tls_switch={switch}\n")
    role_tasks_play(tmp_path / "zk.yml", "zk1", "zookeeper", "quorum_tls_switch.yml",
                    "The role's quorum TLS check")
    run = subprocess.run([tool("ansible-playbook"), "-i", str(tmp_path / "inventory.ini"), str(tmp_path / "zk.yml")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env=ansible_env(),
                         stdin=subprocess.DEVNULL)
    if refused:
        assert run.returncode != 0 and "one server at a time cannot do that" in run.stdout, run.stdout[-3000:]
    else:
        assert run.returncode == 0, run.stdout[-3000:]
    assert (conf / "zoo.cfg").read_text() == current  # nothing changed
