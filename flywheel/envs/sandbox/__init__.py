"""Run untrusted Python written by the agent, contained by the kernel.

Tool-integrated environments (``arith``) hand the code of a ``<python>`` action to ``run_python``
and show the agent the captured stdout, or a one-line error::

    from flywheel.envs.sandbox import run_python
    result = run_python("print(37 + 12)", timeout_s=2.0)
    result.status, result.output, result.error   # ("ok", "49\\n", "")

Layers, each enforced by the kernel, so native code, ctypes or a sub-interpreter meet them too:

- a PID namespace per call: the code sees only its own process, and when the call ends (or
  times out) the kernel kills everything in the namespace, whatever it detached from;
- the helper's network namespace (no interface but a downed loopback), IPC and UTS namespaces;
- a mount namespace per call: the whole filesystem read-only and nosuid, a fresh ``/proc``
  showing only the call's processes, and the private directory a tmpfs of ``disk_mb``;
- the ``nobody`` user (when started as root), no capabilities in any set, locked securebits,
  no_new_privs;
- Landlock (when the kernel has it): reads only in Python's library and system directories,
  writes only in the private directory, no exec, no TCP, no signals out, no abstract sockets;
- a seccomp filter: no new processes, exec, sockets, ptrace, namespaces, mounts, keyrings,
  io_uring, System V IPC, ``setpriority``, ... (``seccomp.py``);
- resource limits: CPU seconds, address space, file size, one process, open files, no cores.

Root, or unprivileged user namespaces, are needed for the namespaces; without them the helper
cannot isolate itself and every call fails with ``sandbox setup failed: ...`` (it never runs
code with less). README "Guarantees" lists what holds and how the tests show it.

Modules: ``runner`` (``run_python``, spawn mode), ``client`` (our side of the fork server),
``server`` (the fork server), ``launch`` (namespaces and the read-only view), ``child`` (a
call's init and the code's process), ``kernel`` (syscalls through ctypes), ``seccomp``.
Benchmark: ``.venv/bin/python -m benchmarks.bench_sandbox``.
"""

from flywheel.envs.sandbox.runner import MAX_CONCURRENT, Mode, SandboxResult, Status, run_python

__all__ = ["MAX_CONCURRENT", "Mode", "SandboxResult", "Status", "run_python"]
