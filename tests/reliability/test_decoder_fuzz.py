"""Byte-level fuzz of the engine-core message decoders: any bytes raise only msgspec's DecodeError."""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.messages import FromEngine, ToEngine

TO_ENGINE = msgspec.msgpack.Decoder(ToEngine)
FROM_ENGINE = msgspec.msgpack.Decoder(FromEngine)
VALID = msgspec.msgpack.encode(["add", ["r1", [1, 2, 3], {"max_tokens": 4}, None, 0.0, 0, None]])


def _decode_or_decode_error(decoder, data: bytes) -> None:
    try:
        decoder.decode(data)
    except msgspec.DecodeError:  # ValidationError is a DecodeError
        pass


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_random_bytes(data):
    _decode_or_decode_error(TO_ENGINE, data)
    _decode_or_decode_error(FROM_ENGINE, data)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), max_size=8),
       st.integers(0, len(VALID)))
def test_mutated_valid_frames(flips, cut):
    data = bytearray(VALID)
    for index, value in flips:
        data[index] = value
    _decode_or_decode_error(TO_ENGINE, bytes(data[:cut] if cut else data))


@settings(max_examples=150, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text()
                    | st.binary(),
                    lambda children: st.lists(children) | st.dictionaries(st.text(), children), max_leaves=30))
def test_well_formed_msgpack_of_any_shape(value):
    data = msgspec.msgpack.encode(["add", value])
    _decode_or_decode_error(TO_ENGINE, data)
    _decode_or_decode_error(TO_ENGINE, msgspec.msgpack.encode(value))
