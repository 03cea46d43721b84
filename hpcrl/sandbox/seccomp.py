"""The seccomp filter of sandboxed programs: no new user namespaces.

Why: inside a user namespace of its own a program is root there, and may then mount a tmpfs of any
size (half the host's memory by default) past `disk_mb`, or use any other kernel code that user
namespaces open up. The filter makes `unshare` and `clone` with CLONE_NEWUSER fail with EPERM, and
`clone3` (whose flags sit in a struct a filter cannot read) fail with ENOSYS, which makes glibc fall
back to `clone` for threads and fork. System calls of another ABI (x32, i386 on x86_64) fail with
EPERM. Everything else is allowed.

The caller builds the BPF program here (plain bytes, cached); the launcher installs it with
prctl(PR_SET_SECCOMP) in the program's process, after no_new_privs and the uid drop, right before
execve, so that it binds the program and everything it starts.
"""

from __future__ import annotations

import functools
import os
import struct

CLONE_NEWUSER = 0x10000000
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
EPERM, ENOSYS = 1, 38

# BPF opcodes (linux/filter.h)
_LD_W_ABS = 0x20
_JEQ_K, _JGE_K, _JSET_K = 0x15, 0x35, 0x45
_RET_K = 0x06

# machine -> (AUDIT_ARCH, clone, unshare, clone3)
_ARCHES = {
    "x86_64": (0xC000003E, 56, 272, 435),
    "aarch64": (0xC00000B7, 220, 97, 435),
}
# offsets in struct seccomp_data: nr, arch, then instruction_pointer, args[6] (low half first: little-endian)
_NR, _ARCH, _ARG0_LOW = 0, 4, 16


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


@functools.lru_cache(maxsize=1)
def no_user_namespaces_filter() -> bytes:
    """The filter as `struct sock_filter[]` bytes; ValueError on a machine it is not written for."""
    machine = os.uname().machine
    if machine not in _ARCHES:
        raise ValueError(f"the sandbox's seccomp filter knows the system calls of {', '.join(_ARCHES)}, not "
                         f"{machine}")
    arch, clone, unshare, clone3 = _ARCHES[machine]
    eperm, enosys = SECCOMP_RET_ERRNO | EPERM, SECCOMP_RET_ERRNO | ENOSYS
    prog = [
        _insn(_LD_W_ABS, _ARCH),                          # 0
        _insn(_JEQ_K, arch, 0, 9),                        # 1: another ABI -> 11 (EPERM)
        _insn(_LD_W_ABS, _NR),                            # 2
        _insn(_JGE_K, 0x40000000, 7, 0),                  # 3: x32 system calls -> 11 (EPERM)
        _insn(_JEQ_K, clone3, 7, 0),                      # 4: clone3 -> 12 (ENOSYS)
        _insn(_JEQ_K, unshare, 2, 0),                     # 5: -> 8
        _insn(_JEQ_K, clone, 1, 0),                       # 6: -> 8
        _insn(_RET_K, SECCOMP_RET_ALLOW),                 # 7
        _insn(_LD_W_ABS, _ARG0_LOW),                      # 8: the flags
        _insn(_JSET_K, CLONE_NEWUSER, 1, 0),              # 9: -> 11
        _insn(_RET_K, SECCOMP_RET_ALLOW),                 # 10
        _insn(_RET_K, eperm),                             # 11
        _insn(_RET_K, enosys),                            # 12
    ]
    return b"".join(prog)
