"""The Linux calls the sandbox needs that ``os`` does not offer, through ctypes and libc.

Namespaces (``unshare``, ``setns``), mounts (``mount``, ``mount_setattr``), capabilities
(bounding set, securebits, ``capset``), ``prctl`` flags and Landlock. Every function raises
``OSError`` with the call's name when the kernel refuses, so a caller decides what is fatal.
Runs in the fork server and in each call's child (never in the trainer's process).
"""

from __future__ import annotations

import ctypes
import functools
import os
import stat
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_THREAD = 0x00010000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 1 << 18

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
# securebits: no capabilities for uid 0 on exec, no ambient raise, keep-caps off; all locked
SECUREBITS_LOCKED_DOWN = (1 << 0) | (1 << 1) | (1 << 5) | (1 << 6) | (1 << 7)

_MOUNT_SETATTR = 442  # the same number on every architecture
_LANDLOCK_CREATE, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT = 444, 445, 446
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
_AT_FDCWD, _AT_RECURSIVE = -100, 0x8000

_libc: Any = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _check(rc: int, what: str) -> int:
    if rc < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")
    return rc


def _path(p: str | None) -> bytes | None:
    return None if p is None else os.fsencode(p)


def syscall(nr: int, *args: Any) -> int:
    return int(_libc.syscall(ctypes.c_long(nr), *args))


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(
            _path(source), _path(target), _path(fstype), ctypes.c_ulong(flags), _path(data or None)
        ),
        f"mount {target}",
    )


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def set_mount_attrs_recursive(path: str, attrs: int) -> None:
    """``mount_setattr(path, AT_RECURSIVE)``: add ``attrs`` to every mount at or under path."""
    attr = _MountAttr(attrs, 0, 0, 0)
    rc = syscall(
        _MOUNT_SETATTR,
        ctypes.c_int(_AT_FDCWD),
        _path(path),
        ctypes.c_uint(_AT_RECURSIVE),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    _check(rc, f"mount_setattr {path}")


def prctl(option: int, arg2: int = 0, arg3: int = 0) -> int:
    return _check(
        _libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(arg3), 0, 0),
        f"prctl({option})",
    )


def set_parent_death_signal(signum: int) -> None:
    prctl(PR_SET_PDEATHSIG, signum)


def set_no_new_privs() -> None:
    prctl(PR_SET_NO_NEW_PRIVS, 1)


@functools.cache
def last_capability() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except OSError:
        return 40  # CAP_CHECKPOINT_RESTORE, the last one in Linux 5.9 to 6.x


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_privileges(uid: int | None, gid: int | None) -> None:
    """Give up every capability for good, and become ``uid``/``gid`` unless None.

    Empties the bounding and ambient sets and locks the securebits (so no later exec or setuid
    can bring a capability back), changes ids, then clears the permitted, effective and
    inheritable sets. Needs CAP_SETPCAP (and CAP_SETUID/CAP_SETGID to change ids).
    """
    for cap in range(last_capability() + 1):
        prctl(PR_CAPBSET_DROP, cap)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    prctl(PR_SET_SECUREBITS, SECUREBITS_LOCKED_DOWN)
    if gid is not None:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
    if uid is not None:
        os.setresuid(uid, uid, uid)
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")


# -- Landlock ---------------------------------------------------------------------------------

# filesystem rights, by ABI version: execute, write_file, read_file, read_dir, remove_dir,
# remove_file, make_char, make_dir, make_reg, make_sock, make_fifo, make_block, make_sym (1),
# refer (2), truncate (3), ioctl_dev (5)
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1, 2, 4, 8
FS_READ = FS_READ_FILE | FS_READ_DIR


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 without Landlock."""
    return max(0, syscall(_LANDLOCK_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint(1)))


def landlock_fs_rights(abi: int) -> int:
    rights = (1 << 13) - 1
    for version, bit in ((2, 13), (3, 14), (5, 15)):
        if abi >= version:
            rights |= 1 << bit
    return rights


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_restrict(rules: list[tuple[str, int]]) -> int:
    """Confine this process (and what it starts) to ``rules``: (path, rights beneath it).

    Every filesystem right the kernel knows is handled, so whatever no rule grants is refused;
    from ABI 4, TCP bind and connect are refused; from ABI 6, signals to processes outside the
    domain and abstract unix sockets outside it. Returns the ABI version used (0: no Landlock,
    nothing done). Needs no_new_privs (or CAP_SYS_ADMIN). Paths that do not exist are skipped.
    """
    abi = landlock_abi()
    if abi < 1:
        return 0
    handled = landlock_fs_rights(abi)
    attr = _RulesetAttr(handled, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = _check(
        syscall(_LANDLOCK_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint(0)),
        "landlock_create_ruleset",
    )
    try:
        for path, rights in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    rights &= FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | (1 << 14) | (1 << 15)
                rule = _PathBeneath(rights & handled, fd)
                _check(syscall(_LANDLOCK_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0), path)
            finally:
                os.close(fd)
        _check(syscall(_LANDLOCK_RESTRICT, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    return abi
