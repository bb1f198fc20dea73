#!/usr/bin/python3
"""Writes the seed corpora of safetensors_fuzz and npy_fuzz into fuzz/corpus/safetensors/ and
fuzz/corpus/npy/.

Standard library only (struct, json): each file is built from the format's definition,
    safetensors: u64 little-endian header length N | N bytes of JSON header | data
    .npy:        "\x93NUMPY" | major, minor | header length (u16, or u32 from 2.0) | dict | data
so that the seeds do not depend on the writer under test. The safetensors seeds cover each dtype,
metadata, the Hugging Face layouts read by from_pretrained, optimizer state, edge cases that are
valid (empty file, zero-sized tensors, scalars, unaligned data) and a few malformed files; the
.npy seeds each format version, both dtypes, 1-D and 2-D, empty arrays, the header spellings
numpy.load accepts, special values, and files broken in one way each. All are small (libFuzzer
runs with -max_len=4096). Files named crash-* (inputs that once crashed a target, kept as
regression seeds) are left alone. Run: /usr/bin/python3 fuzz/make_corpus.py
"""
import json
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus", "safetensors")
OUT_NPY = os.path.join(HERE, "corpus", "npy")

SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
         "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def pattern(nbytes, seed):
    """Deterministic bytes (a small LCG), so that regenerating gives identical files."""
    out = bytearray()
    x = seed * 2654435761 + 12345
    for _ in range(nbytes):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        out.append((x >> 16) & 0xFF)
    return bytes(out)


def pack(header_obj=None, data=b"", header_text=None, pad=True, length=None):
    text = header_text if header_text is not None else json.dumps(header_obj, separators=(",", ":"))
    raw = text.encode("utf-8")
    if pad:
        raw += b" " * ((8 - len(raw) % 8) % 8)
    n = len(raw) if length is None else length
    return struct.pack("<Q", n) + raw + data


def tensors_file(specs, metadata=None, pad=True, data_override=None):
    """specs: list of (name, dtype, shape, data or None); data defaults to a byte pattern."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    blob = b""
    for i, (name, dtype, shape, data) in enumerate(specs):
        nbytes = numel(shape) * SIZES[dtype]
        if data is None:
            data = pattern(nbytes, i + 1)
        assert len(data) == nbytes, name
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(blob), len(blob) + nbytes]}
        blob += data
    return pack(header, blob if data_override is None else data_override, pad=pad)


def f32(*values):
    return struct.pack("<%df" % len(values), *values)


def f64(*values):
    return struct.pack("<%dd" % len(values), *values)


def u16(*values):
    return struct.pack("<%dH" % len(values), *values)


def seeds():
    inf, nan = float("inf"), float("nan")
    s = {}
    # One valid file per dtype, with values that matter for conversion.
    s["f32_matrix"] = tensors_file([("w", "F32", [2, 3], f32(1.5, -0.0, 3.0e38, 1e-45, -2.25, 7.0))])
    s["f64_vector"] = tensors_file([("b", "F64", [4], f64(0.1, -1e300, 1e-300, 2.5))])
    s["f16_matrix"] = tensors_file([("h", "F16", [3, 2], u16(0x3C00, 0xC000, 0x7BFF, 0x0001, 0x8400, 0x3555))])
    s["bf16_matrix"] = tensors_file([("g", "BF16", [2, 2], u16(0x3F80, 0x4049, 0xFF7F, 0x0001))])
    for dtype in ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "I32", "U32", "I64", "U64"):
        s["other_dtype_" + dtype.lower()] = tensors_file([("x", dtype, [2, 2], None)])
    s["non_finite_each_dtype"] = tensors_file([
        ("a", "F32", [3], f32(inf, -inf, nan)), ("b", "F64", [2], f64(nan, 1.0)),
        ("c", "F16", [2], u16(0x7C00, 0x7E00)), ("d", "BF16", [2], u16(0x7F80, 0xFFC1))])
    s["all_float_dtypes_metadata"] = tensors_file(
        [("a", "F32", [2, 2], None), ("b", "F64", [2], None), ("c", "F16", [1, 4], None), ("d", "BF16", [4, 1], None)],
        metadata={"format": "pt", "note": "seed"})
    # Hugging Face layouts (from_pretrained): GPT-2 tied with positions, prefixed; Llama untied.
    s["gpt2_tied"] = tensors_file([("wte.weight", "F32", [5, 3], None), ("wpe.weight", "F32", [4, 3], None)],
                                  metadata={"format": "pt"})
    s["gpt2_prefixed_bf16"] = tensors_file([("transformer.wte.weight", "BF16", [4, 2], None),
                                            ("transformer.wpe.weight", "BF16", [2, 2], None)])
    s["llama_untied"] = tensors_file([("model.embed_tokens.weight", "F16", [4, 3], None),
                                      ("lm_head.weight", "F16", [4, 3], None)])
    s["llama_untied_bias"] = tensors_file([("model.embed_tokens.weight", "F32", [3, 2], None),
                                           ("lm_head.weight", "F32", [3, 2], None), ("lm_head.bias", "F32", [3], None)])
    same = f32(1, 2, 3, 4, 5, 6)
    s["llama_tied_both_equal"] = tensors_file([("model.embed_tokens.weight", "F32", [3, 2], same),
                                               ("lm_head.weight", "F32", [3, 2], same)])
    # Optimizer state, as add_optimizer_state writes it.
    s["optimizer_state"] = tensors_file(
        [("optimizer.0.m", "F32", [2, 2], None), ("optimizer.0.v", "F32", [2, 2], None)],
        metadata={"optimizer": "adamw", "optimizer.step": "3", "optimizer.parameters": '[["w",2,2]]'})
    # Valid edge cases.
    s["empty_header"] = pack({})
    s["metadata_only"] = pack({"__metadata__": {"k": "v"}})
    s["zero_sized"] = tensors_file([("z", "F32", [0, 4], b""), ("y", "F16", [3, 0], b""), ("e", "BF16", [0], b"")])
    s["scalar"] = tensors_file([("s", "F64", [], f64(3.25))])
    s["unaligned_unpadded"] = tensors_file([("u", "F64", [1, 3], None), ("v", "F32", [3], None)], pad=False)
    s["three_d"] = tensors_file([("t", "F32", [2, 1, 2], None)])
    s["unicode_name"] = tensors_file([("\u00e9mbed.\u4e2d", "F32", [1, 1], None)], metadata={"\u00fc": "\u00df"})
    # Malformed files (each broken in one way).
    s["bad_empty_file"] = b""
    s["bad_short"] = b"\x05\x00\x00"
    s["bad_length_past_end"] = pack({}, length=1000)
    s["bad_length_huge"] = pack({}, length=0xFFFFFFFFFFFFFFFF)
    s["bad_not_object"] = pack(header_text="[1,2,3]")
    s["bad_json"] = pack(header_text='{"a":{"dtype":"F32",')
    s["bad_duplicate"] = pack(header_text='{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                                          '"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', data=f32(1.0))
    s["bad_overlap"] = pack({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                             "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, f32(1, 2))
    s["bad_gap"] = pack({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, f32(1, 2))
    s["bad_size_mismatch"] = pack({"a": {"dtype": "F16", "shape": [3], "data_offsets": [0, 4]}}, f32(1))
    s["bad_numel_overflow"] = pack({"a": {"dtype": "F32", "shape": [4294967296, 4294967296, 2], "data_offsets": [0, 0]}})
    s["bad_negative_dim"] = pack(header_text='{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}', data=f32(1))
    s["bad_unknown_dtype"] = pack({"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, b"\0" * 16)
    s["bad_extra_field"] = pack({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}}, f32(1))
    s["bad_deep_nesting"] = pack(header_text='{"__metadata__":{"k":[[[[1]]]]}}')
    s["bad_metadata_value"] = pack({"__metadata__": {"k": 1}})
    s["bad_truncated_data"] = tensors_file([("a", "F32", [4], None)], data_override=pattern(10, 1))
    s["bad_trailing_data"] = tensors_file([("a", "F32", [1], None)], data_override=pattern(8, 1))
    s["bad_optimizer_metadata"] = tensors_file(
        [("optimizer.0.m", "F32", [2, 2], None)],
        metadata={"optimizer": "adamw", "optimizer.step": "x", "optimizer.parameters": '[["w",2,2]]'})
    return s


def npy(header_text, data=b"", major=1, pad=True, length=None):
    """An .npy file: magic, version, header length, the dict text (padded with spaces and ended
    with a newline so that the data starts at a multiple of 64, as numpy writes it), data."""
    preamble = 10 if major == 1 else 12
    text = header_text.encode("latin-1")
    if pad:
        text += b" " * ((64 - (preamble + len(text) + 1) % 64) % 64)
    text += b"\n"
    n = len(text) if length is None else length
    size = struct.pack("<H", n) if major == 1 else struct.pack("<I", n)
    return b"\x93NUMPY" + bytes([major, 0]) + size + text + data


def npy_dict(descr="<f4", fortran="False", shape="(2, 3)"):
    return "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (descr, fortran, shape)


def npy_seeds():
    inf, nan = float("inf"), float("nan")
    s = {}
    six = f32(1.5, -0.0, 3.0e38, 1e-45, -2.25, 7.0)
    # Valid files, as numpy.save writes them and as numpy.load also accepts them.
    s["f4_2d"] = npy(npy_dict(), six)
    s["f8_2d"] = npy(npy_dict("<f8", shape="(3, 2)"), f64(0.1, -1e300, 1e-300, 2.5, 1e39, -7.0))
    s["f4_1d"] = npy(npy_dict(shape="(4,)"), f32(1, 2, 3, 4))
    s["f8_1d_specials"] = npy(npy_dict("<f8", shape="(4,)"), f64(inf, -inf, nan, 1.0 + 2.0 ** -24))
    s["f4_specials"] = npy(npy_dict(shape="(1, 4)"), f32(inf, -inf, nan, -0.0))
    s["f4_empty_rows"] = npy(npy_dict(shape="(0, 3)"))
    s["f8_empty_cols"] = npy(npy_dict("<f8", shape="(4, 0)"))
    s["f4_empty_1d"] = npy(npy_dict(shape="(0,)"))
    s["version_2"] = npy(npy_dict(shape="(2, 1)"), f32(1, 2), major=2)
    s["version_3"] = npy(npy_dict("<f8", shape="(1, 1)"), f64(2.5), major=3)
    s["double_quotes_spacing_unpadded"] = npy('{ "shape" : (2 , 1) , "descr":"<f4","fortran_order":False}',
                                              f32(1, 2), pad=False)
    s["no_trailing_comma"] = npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1)}", f32(3))
    s["wide_header"] = npy(npy_dict(shape="(1, 300)"), f32(*range(300)))
    # Files load_npy refuses, each for one reason (broken, or outside what it reads: 0-D, 3-D, ...).
    s["bad_empty"] = b""
    s["bad_short"] = b"\x93NUMPY\x01"
    s["bad_magic"] = b"\x93NUMPZ" + npy(npy_dict(), six)[6:]
    s["bad_version"] = b"\x93NUMPY\x04\x00" + npy(npy_dict(), six)[8:]
    s["bad_header_past_end"] = npy(npy_dict(), six, length=4000)
    s["bad_header_over_limit"] = npy(npy_dict(), six, length=10001)
    s["bad_truncated_data"] = npy(npy_dict(), six[:20])
    s["bad_trailing_data"] = npy(npy_dict(), six + b"xx")
    s["bad_dtype_int"] = npy(npy_dict("<i4"), six)
    s["bad_dtype_big_endian"] = npy(npy_dict(">f4"), six)
    s["bad_fortran"] = npy(npy_dict(fortran="True"), six)
    s["bad_3d"] = npy(npy_dict(shape="(1, 2, 3)"), six)
    s["bad_0d"] = npy(npy_dict(shape="()"), six[:4])
    s["bad_too_large"] = npy(npy_dict(shape="(4611686018427387904, 4)"), six)
    s["bad_shape_overflow"] = npy(npy_dict(shape="(18446744073709551616, 1)"), six)
    s["bad_negative_dim"] = npy(npy_dict(shape="(-2, 3)"), six)
    s["bad_missing_key"] = npy("{'descr': '<f4', 'shape': (2, 3), }", six)
    s["bad_repeated_key"] = npy("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", six)
    s["bad_not_dict"] = npy("['descr', '<f4']", six)
    s["bad_unterminated"] = npy("{'descr: '<f4}", six)
    s["bad_escape"] = npy("{'descr': '<f\\4', 'fortran_order': False, 'shape': (2, 3), }", six)
    return s


def write_corpus(directory, corpus, suffix):
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):
        if not name.startswith("crash-"):
            os.remove(os.path.join(directory, name))
    for name, data in sorted(corpus.items()):
        assert len(data) <= 4096, name
        with open(os.path.join(directory, name + suffix), "wb") as f:
            f.write(data)
    print("make_corpus: wrote %d seeds to %s" % (len(corpus), directory))


def main():
    write_corpus(OUT, seeds(), ".safetensors")
    write_corpus(OUT_NPY, npy_seeds(), ".npy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
