"""Run a command inside the parts of a unit's sandbox that can be rebuilt without systemd.

    python -m tests.ops.sandbox --unit deploy/systemd/pagoda-worker.service \
        [--drop-in FILE] [--default-action errno|kill] -- COMMAND ...

From the unit (and drop-ins) it applies, then execs COMMAND:
- NoNewPrivileges=yes (prctl);
- SystemCallFilter= lines, as systemd combines them (the first names the allowed set, a
  later `~` line takes calls out of it), with SystemCallArchitectures=native and
  SystemCallErrorNumber=; `--default-action kill` kills on a refused call instead, to learn
  whether the command makes one at all;
- RestrictAddressFamilies= (socket() for other families is refused);
- ProcSubset=pid and ProtectProc=invisible, as a private /proc in a new mount namespace,
  when this process may mount (root); otherwise it says so on stderr and goes on.

The syscall groups are expanded from `systemd-analyze syscall-filter`, so the filter is
the one this host's systemd would build. libseccomp is used through ctypes (Debian's
libseccomp2 is installed wherever systemd is).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

SCMP_ACT_KILL_PROCESS = 0x80000000
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_EQ = 4
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_REC, MS_PRIVATE = 0x4000, 1 << 18


class ScmpArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def scmp_act_errno(number: int) -> int:
    return 0x00050000 | (number & 0xFFFF)


def syscall_groups() -> dict[str, list[str]]:
    """Every @group systemd knows, with its members (calls and nested @groups)."""
    listing = subprocess.run(
        ["systemd-analyze", "syscall-filter"], capture_output=True, text=True, check=True
    ).stdout
    groups: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in listing.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), [])
        elif line.startswith(" ") and current is not None:
            name = line.strip()
            if name and not name.startswith("#"):
                current.append(name)
        else:
            current = None
    return groups


def expand(names: list[str], groups: dict[str, list[str]]) -> set[str]:
    calls: set[str] = set()
    pending = list(names)
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        if name.startswith("@"):
            pending.extend(groups[name])
        else:
            calls.add(name)
    return calls


def unit_settings(paths: list[Path]) -> dict[str, list[str]]:
    """[Service] assignments in order; an empty one resets the list (as systemd does)."""
    settings: dict[str, list[str]] = {}
    for path in paths:
        section = None
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("["):
                section = line
                continue
            if section != "[Service]" or "=" not in line:
                continue
            key, value = line.split("=", 1)
            if value == "":
                settings[key] = []
            else:
                settings.setdefault(key, []).append(value)
    return settings


def allowed_calls(filter_lines: list[str], groups: dict[str, list[str]]) -> set[str]:
    """systemd's reading: the first line decides allow-list or deny-list; later lines of
    the other kind take calls out of (or, for a deny-list, put them back into) the set."""
    if not filter_lines or filter_lines[0].startswith("~"):
        raise SystemExit("sandbox: only allow-list filters (a first line without ~) are built")
    allowed: set[str] = set()
    for line in filter_lines:
        if line.startswith("~"):
            allowed -= expand(line[1:].split(), groups)
        else:
            allowed |= expand(line.split(), groups)
    return allowed


def load_filter(allowed: set[str], families: list[str], default_action: int) -> None:
    lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(ScmpArgCmp),
    ]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    context = lib.seccomp_init(default_action)
    if not context:
        raise SystemExit("sandbox: seccomp_init failed")
    restrict_sockets = bool(families) and "socket" in allowed
    for name in sorted(allowed):
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0 or (restrict_sockets and name == "socket"):
            continue  # not a call on this architecture (or added per family below)
        if lib.seccomp_rule_add_array(context, SCMP_ACT_ALLOW, number, 0, None) < 0:
            raise SystemExit(f"sandbox: cannot allow {name}")
    if restrict_sockets:
        number = lib.seccomp_syscall_resolve_name(b"socket")
        for family in families:
            compare = ScmpArgCmp(0, SCMP_CMP_EQ, getattr(socket, family), 0)
            if lib.seccomp_rule_add_array(context, SCMP_ACT_ALLOW, number, 1, compare) < 0:
                raise SystemExit(f"sandbox: cannot allow socket({family})")
    if lib.seccomp_load(context) < 0:
        raise SystemExit("sandbox: seccomp_load failed")


def private_proc(options: str) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        return False
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return False
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    return libc.mount(b"proc", b"/proc", b"proc", flags, options.encode()) == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.ops.sandbox")
    parser.add_argument("--unit", type=Path, required=True)
    parser.add_argument("--drop-in", type=Path, action="append", default=[])
    parser.add_argument("--default-action", choices=["errno", "kill"], default="errno")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command")
    settings = unit_settings([args.unit, *args.drop_in])

    proc_options = []
    if settings.get("ProtectProc", [""])[-1] == "invisible":
        proc_options.append("hidepid=invisible")
    if settings.get("ProcSubset", [""])[-1] == "pid":
        proc_options.append("subset=pid")
    if proc_options and not private_proc(",".join(proc_options)):
        print("sandbox: cannot mount a private /proc here; /proc stays as it is", file=sys.stderr)

    if settings.get("NoNewPrivileges", ["no"])[-1] == "yes":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise SystemExit("sandbox: prctl(PR_SET_NO_NEW_PRIVS) failed")
    filter_lines = settings.get("SystemCallFilter", [])
    if filter_lines:
        error_name = settings.get("SystemCallErrorNumber", ["EPERM"])[-1]
        if args.default_action == "kill":
            action = SCMP_ACT_KILL_PROCESS
        else:
            action = scmp_act_errno(getattr(errno, error_name))
        families = " ".join(settings.get("RestrictAddressFamilies", [])).split()
        load_filter(allowed_calls(filter_lines, syscall_groups()), families, action)
    os.execvp(command[0], command)
    return 127


if __name__ == "__main__":
    sys.exit(main())
