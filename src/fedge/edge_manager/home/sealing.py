"""A backup sealed with a passphrase (issue 27, item 3): scrypt, then AES-256-GCM in chunks.

The key is derived with scrypt (Percival 2009; RFC 7914) from the passphrase and a
random 16-byte salt, so every sealed file has its own key. The plaintext is cut into
1 MiB chunks, each sealed with AES-GCM under the STREAM construction of Hoang,
Reyhanitabar, Rogaway and Vizar (CRYPTO 2015, "Online authenticated-encryption and its
nonce-reuse misuse-resistance"): the nonce is a random prefix, the chunk's counter and a
flag on the last chunk, and the header is every chunk's associated data. A chunk moved,
dropped, altered, or a file cut short fails to open; memory stays one chunk whatever the
archive's size (model artifacts can be large).

    MAGIC(8) | salt(16) | log2 n(1) | r(1) | p(1) | nonce prefix(7)     the header
    then per chunk: length(4, big-endian) | ciphertext + 16-byte tag

The passphrase is never written, logged or kept: callers pass its bytes in.
"""

import os
import struct
from pathlib import Path
from typing import BinaryIO

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from fedge.edge_manager.errors import ManagerError

MAGIC = b"FEDGEBK1"
CHUNK = 1 << 20
# scrypt's cost: n = 2^15, r = 8 (32 MiB and ~0.1 s per derivation), p = 1: RFC 7914's
# interactive-use parameters, doubled in n.
LOG2_N, R, P = 15, 8, 1
_HEADER = struct.Struct(">8s16sBBB7s")
_LENGTH = struct.Struct(">I")
MIN_PASSPHRASE = 8


class SealError(ManagerError):
    """A sealed backup that cannot be opened: wrong passphrase, altered or cut short."""


def _key(passphrase: bytes, salt: bytes, log2_n: int, r: int, p: int) -> bytes:
    if not 10 <= log2_n <= 22 or not 1 <= r <= 32 or not 1 <= p <= 16:
        raise SealError(f"scrypt parameters out of range (n=2^{log2_n}, r={r}, p={p})")
    return Scrypt(salt=salt, length=32, n=1 << log2_n, r=r, p=p).derive(passphrase)


def _nonce(prefix: bytes, counter: int, last: bool) -> bytes:
    return prefix + struct.pack(">I", counter) + (b"\x01" if last else b"\x00")


def check_passphrase(passphrase: bytes) -> None:
    if len(passphrase) < MIN_PASSPHRASE:
        raise ManagerError(
            f"a backup passphrase has at least {MIN_PASSPHRASE} characters; give a longer one"
        )


def is_sealed(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(len(MAGIC)) == MAGIC


def seal(source: BinaryIO, target: BinaryIO, passphrase: bytes) -> None:
    """Write ``source``'s bytes sealed to ``target``."""
    check_passphrase(passphrase)
    header = _HEADER.pack(MAGIC, os.urandom(16), LOG2_N, R, P, os.urandom(7))
    _, salt, log2_n, r, p, prefix = _HEADER.unpack(header)
    aead = AESGCM(_key(passphrase, salt, log2_n, r, p))
    target.write(header)
    counter = 0
    chunk = source.read(CHUNK)
    while True:
        following = source.read(CHUNK)
        last = not following
        sealed = aead.encrypt(_nonce(prefix, counter, last), chunk, header)
        target.write(_LENGTH.pack(len(sealed)) + sealed)
        if last:
            return
        chunk, counter = following, counter + 1


def unseal(source: BinaryIO, target: BinaryIO, passphrase: bytes) -> None:
    """Write the plaintext of the sealed ``source`` to ``target`` (SealError if it is not
    exactly what :func:`seal` wrote with this passphrase)."""
    header = source.read(_HEADER.size)
    if len(header) < _HEADER.size or not header.startswith(MAGIC):
        raise SealError("not a sealed fedge backup (no FEDGEBK1 header)")
    _, salt, log2_n, r, p, prefix = _HEADER.unpack(header)
    aead = AESGCM(_key(passphrase, salt, log2_n, r, p))
    counter = 0
    while True:
        length = source.read(_LENGTH.size)
        if len(length) < _LENGTH.size:
            raise SealError("the sealed backup is cut short (no final chunk): copy it again")
        (size,) = _LENGTH.unpack(length)
        if size > CHUNK + 16:
            raise SealError(f"chunk {counter} claims {size} bytes: the file was altered")
        sealed = source.read(size)
        if len(sealed) < size:
            raise SealError("the sealed backup is cut short: copy it again")
        # Try the chunk as the last one only if nothing follows it.
        last = source.read(1) == b""
        if not last:
            source.seek(-1, os.SEEK_CUR)
        try:
            target.write(aead.decrypt(_nonce(prefix, counter, last), sealed, header))
        except InvalidTag:
            if counter == 0:
                raise SealError(
                    "cannot open the sealed backup: wrong passphrase, or the file was altered"
                ) from None
            raise SealError(
                f"chunk {counter} of the sealed backup fails its check: the file was altered "
                "or cut short"
            ) from None
        if last:
            return
        counter += 1
