"""A seccomp filter for the sandbox: the system calls no tool call needs, refused with EPERM.

    program = deny_filter()            # bytes: a classic-BPF program (struct sock_filter[]), or None
    bwrap --seccomp FD ...             # bubblewrap loads it from a file descriptor holding these bytes

The kernel namespaces already hide the host; this layer takes away the calls that attack the kernel
or escape a namespace from inside it: ptrace and reading another process's memory, mount and the new
mount API, unshare / setns (no nested namespaces), module loading, kexec, bpf, perf events,
userfaultfd, io_uring (whose requests bypass a filter on the other calls), keyrings, reboot and swap.
A program for another architecture's calling convention (i386 calls from an x86_64 process, x32) is
killed.  x86_64 and aarch64 are covered; elsewhere `deny_filter()` gives None and the sandbox runs
without this layer (`megatron-rl sandbox check` says so).
"""

from __future__ import annotations

import platform
import struct

# classic BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h)
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06
_RET_ALLOW = 0x7FFF0000
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO_EPERM = 0x00050000 | 1
_OFFSET_NR, _OFFSET_ARCH = 0, 4  # struct seccomp_data: int nr; u32 arch; ...
_X32_SYSCALL_BIT = 0x40000000

DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot",
          "unshare", "setns", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
          "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key", "reboot", "swapon",
          "swapoff", "acct", "quotactl", "open_by_handle_at", "name_to_handle_at", "io_uring_setup",
          "io_uring_enter", "io_uring_register", "kcmp", "syslog", "open_tree", "move_mount", "fsopen",
          "fsconfig", "fsmount", "mount_setattr")

# (audit arch, system call numbers) of the two architectures covered
_X86_64 = (0xC000003E, dict(
    ptrace=101, process_vm_readv=310, process_vm_writev=311, mount=165, umount2=166, pivot_root=155, chroot=161,
    unshare=272, setns=308, kexec_load=246, kexec_file_load=320, init_module=175, finit_module=313,
    delete_module=176, bpf=321, perf_event_open=298, userfaultfd=323, keyctl=250, add_key=248, request_key=249,
    reboot=169, swapon=167, swapoff=168, acct=163, quotactl=179, open_by_handle_at=304, name_to_handle_at=303,
    io_uring_setup=425, io_uring_enter=426, io_uring_register=427, kcmp=312, syslog=103, open_tree=428,
    move_mount=429, fsopen=430, fsconfig=431, fsmount=432, mount_setattr=442))
_AARCH64 = (0xC00000B7, dict(
    ptrace=117, process_vm_readv=270, process_vm_writev=271, mount=40, umount2=39, pivot_root=41, chroot=51,
    unshare=97, setns=268, kexec_load=104, kexec_file_load=294, init_module=105, finit_module=273,
    delete_module=106, bpf=280, perf_event_open=241, userfaultfd=282, keyctl=219, add_key=217, request_key=218,
    reboot=142, swapon=224, swapoff=225, acct=89, quotactl=60, open_by_handle_at=265, name_to_handle_at=264,
    io_uring_setup=425, io_uring_enter=426, io_uring_register=427, kcmp=272, syslog=116, open_tree=428,
    move_mount=429, fsopen=430, fsconfig=431, fsmount=432, mount_setattr=442))
ARCHES = {"x86_64": _X86_64, "amd64": _X86_64, "aarch64": _AARCH64, "arm64": _AARCH64}


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def deny_filter(machine: str | None = None) -> bytes | None:
    """The BPF program refusing DENIED on this machine's architecture; None where it is not covered."""
    arch = ARCHES.get((machine or platform.machine()).lower())
    if arch is None:
        return None
    audit_arch, numbers = arch
    prog = [_insn(_LD_W_ABS, 0, 0, _OFFSET_ARCH),
            _insn(_JEQ_K, 1, 0, audit_arch),
            _insn(_RET_K, 0, 0, _RET_KILL_PROCESS),
            _insn(_LD_W_ABS, 0, 0, _OFFSET_NR)]
    if audit_arch == _X86_64[0]:  # x32 calls carry this bit: refuse the whole ABI
        prog += [_insn(_JGE_K, 0, 1, _X32_SYSCALL_BIT), _insn(_RET_K, 0, 0, _RET_ERRNO_EPERM)]
    denied = sorted({numbers[name] for name in DENIED})
    for i, nr in enumerate(denied):  # on a match jump to the EPERM return after the last comparison
        prog.append(_insn(_JEQ_K, len(denied) - i, 0, nr))
    prog += [_insn(_RET_K, 0, 0, _RET_ALLOW), _insn(_RET_K, 0, 0, _RET_ERRNO_EPERM)]
    return b"".join(prog)
