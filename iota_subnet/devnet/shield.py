"""The devnet's MEV shield: ``MevShield.NextKey`` holds an ML-KEM-768 public key; a
``MevShield.submit_encrypted`` carrier is ``[key_hash 16][u16 kem_len][kem_ct][nonce 24][aead_ct]``
(ML-KEM-768 + XChaCha20-Poly1305, the SDK's ``encrypt_mlkem768`` format) whose plaintext is a
signed inner extrinsic: JSON ``{call, signer, crypto, nonce, period}`` followed by the signer's
64-byte signature over it. The key pair is made on first use and kept in the file's ``meta``.
"""
from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from .schema import DevnetCall, Refused, json_default

if TYPE_CHECKING:  # pragma: no cover
    from .state import DevnetState


def mev_public_key(st: DevnetState) -> bytes:
    """The shield's ML-KEM-768 encapsulation key (``MevShield.NextKey``); created on first use."""
    return bytes.fromhex(_mev_keys(st)[0])


def _mev_keys(st: DevnetState) -> tuple[str, str]:
    ek, dk = st.meta("mev_ek"), st.meta("mev_dk")
    if ek is None or dk is None:
        from kyber_py.ml_kem import ML_KEM_768

        new_ek, new_dk = ML_KEM_768.keygen()
        with st.tx() as c:
            c.execute("INSERT OR IGNORE INTO meta VALUES ('mev_ek', ?)", (new_ek.hex(),))
            c.execute("INSERT OR IGNORE INTO meta VALUES ('mev_dk', ?)", (new_dk.hex(),))
        ek, dk = st.meta("mev_ek"), st.meta("mev_dk")
    return ek, dk


def mev_open(st: DevnetState, blob: bytes) -> dict:
    """Decrypt a shielded carrier (``[key_hash 16][u16 kem_len][kem_ct][nonce 24][aead_ct]``,
    ML-KEM-768 + XChaCha20-Poly1305 with the shared secret as key) and check its inner
    extrinsic's signature. Returns ``{"call": [module, function, params], "signer", "hash"}``;
    raises :class:`Refused` for anything that does not open."""
    from Crypto.Cipher import ChaCha20_Poly1305
    from kyber_py.ml_kem import ML_KEM_768

    try:
        n = int.from_bytes(blob[16:18], "little")
        kem, nonce, sealed = blob[18:18 + n], blob[18 + n:42 + n], blob[42 + n:]
        secret = ML_KEM_768.decaps(bytes.fromhex(_mev_keys(st)[1]), kem)
        inner = ChaCha20_Poly1305.new(key=secret, nonce=nonce).decrypt_and_verify(sealed[:-16], sealed[-16:])
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise Refused("BadEncryptedPayload", f"the shielded payload does not decrypt: {e}") from None
    return open_inner_extrinsic(inner)


# -- signed inner extrinsics (the MEV shield's payload) -----------------------------------------

_SIG_BYTES = 64


def seal_inner_extrinsic(call: DevnetCall, keypair: Any, nonce: int, period: int) -> tuple[bytes, str]:
    payload = json.dumps({"call": [call.module, call.function, call.params], "signer": keypair.ss58_address,
                          "crypto": int(getattr(keypair, "crypto_type", 1)), "nonce": int(nonce),
                          "period": int(period)}, default=json_default, sort_keys=True).encode()
    sealed = payload + bytes(keypair.sign(payload))
    return sealed, "0x" + hashlib.blake2b(sealed, digest_size=32).hexdigest()


def open_inner_extrinsic(sealed: bytes) -> dict:
    from bittensor.sp_core import verify

    payload, signature = sealed[:-_SIG_BYTES], sealed[-_SIG_BYTES:]
    try:
        d = json.loads(payload)
        ok = verify(payload, signature, d["signer"], int(d.get("crypto", 1)))
    except (ValueError, KeyError, TypeError) as e:
        raise Refused("BadEncryptedPayload", f"the shielded extrinsic is malformed: {e}") from None
    if not ok:
        raise Refused("BadSignature", "the shielded extrinsic's signature does not verify")
    return {"call": d["call"], "signer": d["signer"],
            "hash": "0x" + hashlib.blake2b(sealed, digest_size=32).hexdigest()}
