"""A seccomp filter, built by hand as classic BPF and installed with ``prctl``.

Why not a binding: the one on PyPI that wraps libseccomp (``pyseccomp``) has had no release
since 2021 and needs the system's libseccomp, and the fork server runs in an isolated
interpreter without site-packages. The filter is a short deny list, so it is written here.

What it does, for the calling thread and everything it starts (it cannot be removed):
the wrong architecture (a 32-bit or x32 entry point, which would number syscalls differently)
kills the process; creating processes (``fork``, ``vfork``, ``clone`` without ``CLONE_THREAD``),
``execve``, sockets, ``ptrace`` and reading other processes' memory, namespaces and mounts,
kernel keyrings, BPF, io_uring (which would run socket calls this filter never sees), module and
clock and reboot calls, ``setpriority``, System V IPC and message queues (which would outlive
the call), ``pidfd_*`` and ``open_by_handle_at`` fail with EPERM; ``clone3`` fails with ENOSYS
(its flags sit behind a pointer the filter cannot read), so libc falls back to ``clone``.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from typing import Any

from flywheel.envs.sandbox import kernel

# name: (x86_64, aarch64); None where the architecture has no such call
DENIED: dict[str, tuple[int | None, int | None]] = {
    "fork": (57, None),
    "vfork": (58, None),
    "execve": (59, 221),
    "execveat": (322, 281),
    "socket": (41, 198),
    "socketpair": (53, 199),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "kcmp": (312, 272),
    "pidfd_open": (434, 434),
    "pidfd_getfd": (438, 438),
    "pidfd_send_signal": (424, 424),
    "unshare": (272, 97),
    "setns": (308, 268),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "mount_setattr": (442, 442),
    "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "reboot": (169, 142),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "acct": (163, 89),
    "quotactl": (179, 60),
    "syslog": (103, 116),
    "settimeofday": (164, 170),
    "clock_settime": (227, 112),
    "clock_adjtime": (305, 266),
    "adjtimex": (159, 171),
    "setpriority": (141, 140),
    "ioprio_set": (251, 30),
    "personality": (135, 92),
    "mknod": (133, None),
    "mknodat": (259, 33),
    "shmget": (29, 194),
    "semget": (64, 190),
    "msgget": (68, 186),
    "mq_open": (240, 180),
    "iopl": (172, None),
    "ioperm": (173, None),
    "vhangup": (153, 58),
}
_CLONE = (56, 220)
_CLONE3 = 435
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_SYSCALL_BIT = 0x40000000

# classic BPF opcodes and seccomp return values
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO, _KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
_EPERM, _ENOSYS = 1, 38
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16  # struct seccomp_data (little-endian low word of arg 0)


class _Insn(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Insn))]


def supported() -> bool:
    return platform.machine() in _AUDIT_ARCH


def program(machine: str | None = None) -> list[tuple[int, int | str, int | str, int]]:
    """The filter as (code, jump-if-true, jump-if-false, k); jumps name a final return."""
    machine = machine or platform.machine()
    column = 0 if machine == "x86_64" else 1
    prog: list[tuple[int, int | str, int | str, int]] = [
        (_LD_ABS, 0, 0, _OFF_ARCH),
        (_JEQ, 0, "kill", _AUDIT_ARCH[machine]),
        (_LD_ABS, 0, 0, _OFF_NR),
    ]
    if machine == "x86_64":
        prog.append((_JGE, "kill", 0, _X32_SYSCALL_BIT))
    prog.append((_JEQ, "enosys", 0, _CLONE3))
    for numbers in DENIED.values():
        nr = numbers[column]
        if nr is not None:
            prog.append((_JEQ, "eperm", 0, nr))
    prog += [
        (_JEQ, 0, "allow", _CLONE[column]),
        (_LD_ABS, 0, 0, _OFF_ARG0),
        (_JSET, "allow", "eperm", kernel.CLONE_THREAD),  # a thread: RLIMIT_NPROC decides
    ]
    return prog


def _assemble(prog: list[tuple[int, int | str, int | str, int]]) -> list[tuple[int, int, int, int]]:
    returns = {"allow": _ALLOW, "eperm": _ERRNO | _EPERM, "enosys": _ERRNO | _ENOSYS}
    returns["kill"] = _KILL_PROCESS
    where = {name: len(prog) + i for i, name in enumerate(returns)}
    out = []
    for pc, (code, jt, jf, k) in enumerate(prog):
        jumps = [j if isinstance(j, int) else where[j] - pc - 1 for j in (jt, jf)]
        if max(jumps) > 255:
            raise ValueError("seccomp filter too long for a one-byte jump")
        out.append((code, jumps[0], jumps[1], k))
    return out + [(_RET, 0, 0, value) for value in returns.values()]


@functools.cache
def _compiled() -> tuple[Any, _Prog]:
    insns = _assemble(program())
    array = (_Insn * len(insns))(*[_Insn(*i) for i in insns])
    return array, _Prog(len(insns), ctypes.cast(array, ctypes.POINTER(_Insn)))


def prepare() -> None:
    """Build the filter now (in the fork server), so that each call only installs it."""
    _compiled()


def install() -> None:
    """Install the filter on this thread (no_new_privs must be set, or CAP_SYS_ADMIN held)."""
    kernel.prctl(22, 2, ctypes.addressof(_compiled()[1]))  # PR_SET_SECCOMP, MODE_FILTER
