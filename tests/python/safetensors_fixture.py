#!/usr/bin/python3
"""safetensors and .npy interoperability between numpy and embedhead, checked both ways.

A safetensors writer and reader written here from the format's specification, with numpy only
(no `safetensors` package):

    u64 little-endian N | N bytes of JSON header | data: raw little-endian tensors
    header = {"<name>": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
              "__metadata__": {"<key>": "<string>"}}      offsets relative to the data section

  generate DIR   writes DIR/py/: safetensors fixtures (F32, F64, F16, BF16; GPT-2 and Llama names;
                 metadata; an unpadded header, so unaligned data; zero-sized, 1-D and scalar
                 tensors; non-finite values), for each tensor the decoded values as .npy sidecars
                 (float64, and float32 = what a float reader must return), .npy files written by
                 numpy.save (some that load_npy must refuse), and manifest.json listing them all.
                 tests/io/python_interop_test.cpp then reads them with embedhead and compares bit
                 for bit, and writes its own files into DIR/cpp/.
  check DIR      reads DIR/cpp/ with the reader here and compares with values recomputed in numpy
                 from the sources the C++ test saved (.npy): F32 exact, F16 = numpy's astype
                 (round to nearest-even, directly from float64 too), BF16 = round to nearest-even
                 computed here, from float32 bits by integer arithmetic and from float64 by a
                 search over all 65536 bf16 values. The .npy files C++ wrote must load with
                 numpy.load and be byte-identical to numpy.save's.

Exits non-zero, naming the file, tensor and first differing element, on any mismatch.
"""
import io
import json
import os
import shutil
import struct
import sys

import numpy as np

DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


class Mismatch(Exception):
    pass


# ---- bfloat16 and float16 rounding, computed independently of any C++ code ----

def bf16_bits_from_f32(x):
    """float32 array -> bf16 bit patterns (uint16), rounded to nearest, ties to even.

    bf16 is the top 16 bits of a float32. Adding 0x7FFF plus the lowest kept bit, then dropping the
    low 16 bits, rounds to nearest with ties to the even pattern; a carry out of the mantissa moves
    to the next binade or, from the largest finite value, to infinity, as IEEE requires.
    """
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    lsb = (bits >> np.uint64(16)) & np.uint64(1)
    rounded = ((bits + np.uint64(0x7FFF) + lsb) >> np.uint64(16)) & np.uint64(0xFFFF)
    quiet_nan = (bits >> np.uint64(16)) | np.uint64(0x0040)
    return np.where(np.isnan(x), quiet_nan, rounded).astype(np.uint16)


def _positive_table(max_finite_bits, inf_bits, decode):
    """Sorted non-negative finite values of a 16-bit format, plus infinity placed at the value
    one ulp past the largest finite one (2^(emax+1)): rounding to nearest-even then sends x to
    infinity exactly when |x| >= max + ulp/2, the IEEE overflow rule."""
    bits = np.arange(0, max_finite_bits + 1, dtype=np.uint16)
    values = decode(bits).astype(np.float64)
    top = values[-1]
    ulp = top - values[-2]
    return np.append(values, top + ulp), np.append(bits, np.uint16(inf_bits))


def _round_by_search(x, table):
    """float64 array -> 16-bit patterns by nearest-value search; ties to the even pattern."""
    values, bits = table
    x = np.asarray(x, dtype=np.float64)
    if np.isnan(x).any():
        raise ValueError("_round_by_search: NaN sources are not used")
    mag = np.abs(x)
    hi = np.clip(np.searchsorted(values, mag, side="left"), 0, len(values) - 1)
    lo = np.clip(hi - 1, 0, len(values) - 1)
    d_lo, d_hi = mag - values[lo], values[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & ((bits[hi] & 1) == 0))
    out = np.where(pick_hi, bits[hi], bits[lo]).astype(np.uint16)
    out = np.where(mag >= values[-1], bits[-1], out)  # beyond the table: infinity
    return (out | np.where(np.signbit(x), np.uint16(0x8000), np.uint16(0))).astype(np.uint16)


def bf16_to_f32(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


BF16_TABLE = _positive_table(0x7F7F, 0x7F80, bf16_to_f32)
F16_TABLE = _positive_table(0x7BFF, 0x7C00, lambda b: b.view(np.float16))


def bf16_bits_from_f64(x):
    return _round_by_search(x, BF16_TABLE)


def f16_bits_from_f64(x):
    return _round_by_search(x, F16_TABLE)


# ---- the format ----

def encode(dtype, array):
    """An array (float32/float64/float16, or uint16 bf16 bits for BF16) -> little-endian bytes."""
    code = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "BF16": "<u2"}[dtype]
    if array.dtype != np.dtype(code):
        raise TypeError("encode: %s wants %s, got %s" % (dtype, code, array.dtype))
    return np.ascontiguousarray(array).astype(code).tobytes()


def decode(dtype, raw, shape):
    """Bytes of a float dtype -> float64 values of the given shape (exact for all four)."""
    if dtype == "BF16":
        values = bf16_to_f32(np.frombuffer(raw, dtype="<u2"))
    else:
        values = np.frombuffer(raw, dtype={"F32": "<f4", "F64": "<f8", "F16": "<f2"}[dtype])
    return values.astype(np.float64).reshape(shape)


def write_safetensors(path, tensors, metadata=None, pad=True):
    """tensors: list of (name, dtype, array); arrays in their stored type (see encode)."""
    header, blobs, offset = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, array in tensors:
        raw = encode(dtype, array)
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    if pad:
        text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_safetensors(path):
    """path -> (tensors {name: (dtype, shape, raw bytes)}, metadata), validated as the format says."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise Mismatch("%s: %d bytes, fewer than 8" % (path, len(data)))
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise Mismatch("%s: header length %d runs past the end" % (path, n))
    text = data[8:8 + n]
    if not text.startswith(b"{"):
        raise Mismatch("%s: header does not start with '{'" % path)
    if len(text.rstrip(b" ")) != len(text.rstrip()):
        raise Mismatch("%s: header padded with something other than spaces" % path)
    header = json.loads(text.decode("utf-8"))
    body = data[8 + n:]
    metadata = header.pop("__metadata__", {})
    tensors, spans = {}, []
    for name, info in header.items():
        if set(info) != {"dtype", "shape", "data_offsets"}:
            raise Mismatch("%s: tensor %r has fields %s" % (path, name, sorted(info)))
        begin, end = info["data_offsets"]
        count = int(np.prod(info["shape"], dtype=np.int64))
        if end - begin != count * DTYPE_BYTES[info["dtype"]]:
            raise Mismatch("%s: tensor %r offsets [%d, %d] do not match %s %s" % (path, name, begin, end,
                                                                                  info["dtype"], info["shape"]))
        tensors[name] = (info["dtype"], tuple(info["shape"]), body[begin:end])
        spans.append((begin, end))
    cursor = 0
    for begin, end in sorted(spans):
        if begin != cursor:
            raise Mismatch("%s: data has a gap or overlap at byte %d" % (path, begin))
        cursor = end
    if cursor != len(body):
        raise Mismatch("%s: tensors cover %d data bytes, the file has %d" % (path, cursor, len(body)))
    return tensors, metadata


def as_table(values):
    """A tensor's values as the [rows, cols] table embedhead reads: 1-D [n, 1], scalar [1, 1]."""
    if values.ndim == 0:
        return values.reshape(1, 1)
    if values.ndim == 1:
        return values.reshape(-1, 1)
    return values


# ---- generate: fixtures for the C++ reader ----

def float32_samples(rng, shape):
    """Random float32 values with the special ones a converter gets wrong first: -0, the smallest
    subnormal, a large subnormal, the smallest normal, the largest bf16 (a float32 too; float32's
    own largest would round to +inf in bf16, which a model load rightly refuses), 1 + 1 ulp."""
    x = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    specials = np.array([-0.0, 1.4e-45, 1.1e-38, 1.17549435e-38, 3.3895314e38, 1.0000001, -2.5, 0.1],
                        dtype=np.float32)
    flat = x.reshape(-1)
    flat[:min(len(specials), flat.size)] = specials[:flat.size]
    return x


def bf16_tie_samples():
    """float32 values halfway between two bf16 values, both parities, and just either side."""
    base = np.array([1.0, 1.0078125, -3.0, 200.0, 1e-3], dtype=np.float32).view(np.uint32)
    halfway = base + np.uint32(0x8000)               # exactly half a bf16 ulp above: ties
    return np.concatenate([base, halfway, halfway + np.uint32(1), halfway - np.uint32(1)]).view(np.float32)


def numpy_pattern(rows, cols, dtype):
    """Values that are exact in float32: (k - 7) * 0.375 for flat index k."""
    return ((np.arange(rows * cols, dtype=np.float64) - 7) * 0.375).reshape(rows, cols).astype(dtype)


def generate(root):
    out = os.path.join(root, "py")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(out)
    os.makedirs(os.path.join(root, "cpp"))
    rng = np.random.default_rng(20240605)
    manifest = {"tensors": [], "pretrained": [], "npy": []}

    def add(file, name, dtype, stored):
        """Records tensor `name` of `file`: sidecars of its float64 values and of the float32 values
        a float reader must produce (exact for F32/F16/BF16; float64 -> float32 RNE for F64)."""
        if dtype == "BF16":
            values = bf16_to_f32(stored).astype(np.float64)
        else:
            values = stored.astype(np.float64)
        with np.errstate(over="ignore"):  # F64 beyond float's range becomes +-inf here ...
            as_f32 = values.astype(np.float32)
        if dtype != "F64":
            assert np.array_equal(as_f32.astype(np.float64), values, equal_nan=True)  # exact in float
        stem = "%s__%s" % (file.replace(".safetensors", ""), name)
        np.save(os.path.join(out, stem + ".f64.npy"), as_table(values))
        np.save(os.path.join(out, stem + ".f32.npy"), as_table(as_f32))
        table = as_table(values)
        entry = {"file": file, "tensor": name, "dtype": dtype, "shape": list(stored.shape),
                 "rows": int(table.shape[0]), "cols": int(table.shape[1]),
                 "f64": stem + ".f64.npy", "f32": stem + ".f32.npy"}
        # ... but a float reader refuses the first finite one (row-major) with a format_error.
        beyond = (np.isfinite(values) & ~np.isfinite(as_f32)).reshape(-1)
        if beyond.any():
            i = int(np.flatnonzero(beyond)[0])
            shape = stored.shape
            where = "(%d, %d)" % (i // shape[1], i % shape[1]) if len(shape) == 2 else "index %d" % i
            entry["float_refused"] = "has the F64 value %g at %s, outside float's range" % (
                values.reshape(-1)[i], where)
        manifest["tensors"].append(entry)

    def fixture(file, tensors, metadata=None, pad=True):
        write_safetensors(os.path.join(out, file), tensors, metadata, pad)
        for name, dtype, stored in tensors:
            add(file, name, dtype, stored)

    # GPT-2 names, F32, tied (no lm_head.weight), learned positions.
    fixture("gpt2_f32.safetensors",
            [("wte.weight", "F32", float32_samples(rng, (11, 6))), ("wpe.weight", "F32", float32_samples(rng, (8, 6)))],
            metadata={"format": "pt"})
    manifest["pretrained"].append({"file": "gpt2_f32.safetensors", "family": "gpt2", "tied": True,
                                   "table": "wte.weight", "positions": "wpe.weight"})
    # Llama names, BF16 (rounded here from float32, with ties), untied.
    table32 = np.concatenate([bf16_tie_samples(), float32_samples(rng, (52,)).reshape(-1)]).reshape(18, 4)
    head32 = float32_samples(rng, (18, 4))
    fixture("llama_bf16.safetensors",
            [("model.embed_tokens.weight", "BF16", bf16_bits_from_f32(table32)),
             ("lm_head.weight", "BF16", bf16_bits_from_f32(head32))],
            metadata={"format": "pt", "source": "safetensors_fixture.py"})
    manifest["pretrained"].append({"file": "llama_bf16.safetensors", "family": "llama", "tied": False,
                                   "table": "model.embed_tokens.weight", "head": "lm_head.weight"})
    # Llama names, F16 (numpy's astype), untied; subnormals, -0, the largest half.
    table16 = (rng.standard_normal((9, 5)) * 0.05).astype(np.float16)
    table16.reshape(-1)[:6] = np.array([6e-8, -6e-8, 6.1e-5, -0.0, 65504.0, 0.3333], dtype=np.float16)
    fixture("llama_f16.safetensors",
            [("model.embed_tokens.weight", "F16", table16),
             ("lm_head.weight", "F16", (rng.standard_normal((9, 5)) * 0.05).astype(np.float16))])
    manifest["pretrained"].append({"file": "llama_f16.safetensors", "family": "llama", "tied": False,
                                   "table": "model.embed_tokens.weight", "head": "lm_head.weight"})
    # F64 with float32 rounding ties, overflow and underflow; 1-D and scalar tensors; the header
    # left unpadded, so the data section (and every F64) is unaligned.
    one = 1.0
    f64_table = np.array([[one + 2.0 ** -24, one + 3 * 2.0 ** -24, one + 2.0 ** -24 + 2.0 ** -60],
                          [-(one + 2.0 ** -24), 1e300, -1e300],
                          [1e-300, 2.0 ** -149 * 0.5, 2.0 ** -149 * 0.75],
                          [0.1, -0.0, 3.4028235677973366e38],
                          [3.4028235677973366e38 * (1 + 2.0 ** -25), np.pi, -np.e]], dtype=np.float64)
    fixture("mixed_f64.safetensors",
            [("table", "F64", f64_table), ("bias", "F64", rng.standard_normal(5)),
             ("scale", "F64", np.array(0.7071067811865476)), ("empty", "F32", np.zeros((0, 3), np.float32))],
            metadata={"note": "unpadded header"}, pad=False)
    # Non-finite values in each dtype (NaN, +-inf), for the reader and first_non_finite.
    special = np.array([np.inf, -np.inf, np.nan, 1.0], dtype=np.float32)
    fixture("special.safetensors",
            [("f32", "F32", special), ("f64", "F64", special.astype(np.float64)),
             ("f16", "F16", special.astype(np.float16)), ("bf16", "BF16", bf16_bits_from_f32(special))])

    # .npy files written by numpy.save for load_npy: accepted ones and ones it must refuse.
    def npy(name, array, ok, reason=""):
        np.save(os.path.join(out, name), array)
        entry = {"file": name, "ok": ok}
        if ok:
            table = as_table(array)
            entry.update(rows=int(table.shape[0]), cols=int(table.shape[1]), pattern=True)
        else:
            entry["reason"] = reason
        manifest["npy"].append(entry)

    npy("np_f32_2d.npy", numpy_pattern(3, 5, np.float32), True)
    npy("np_f64_2d.npy", numpy_pattern(4, 2, np.float64), True)
    npy("np_f64_1d.npy", numpy_pattern(1, 7, np.float64).reshape(-1), True)
    npy("np_f32_empty.npy", numpy_pattern(0, 3, np.float32), True)
    npy("np_f64_fortran.npy", np.asfortranarray(numpy_pattern(3, 4, np.float64)), False, "Fortran order")
    npy("np_i4.npy", np.arange(6, dtype=np.int32).reshape(2, 3), False, "dtype '<i4'")
    npy("np_f64_big_endian.npy", numpy_pattern(2, 2, ">f8"), False, "dtype '>f8'")
    npy("np_f16.npy", numpy_pattern(2, 2, np.float16), False, "dtype '<f2'")
    npy("np_f32_3d.npy", numpy_pattern(2, 6, np.float32).reshape(2, 3, 2), False, "shape (2, 3, 2)")
    npy("np_f64_0d.npy", np.array(1.5), False, "shape ()")

    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    # Our reader reads our writer's files back (the C++ side is checked against the sidecars).
    for entry in manifest["tensors"]:
        tensors, _ = read_safetensors(os.path.join(out, entry["file"]))
        dtype, shape, raw = tensors[entry["tensor"]]
        got = as_table(decode(dtype, raw, shape))
        want = np.load(os.path.join(out, entry["f64"]))
        if not np.array_equal(got, want, equal_nan=True):
            raise Mismatch("self-check: %s/%s does not read back" % (entry["file"], entry["tensor"]))
    print("generate: %d tensors in %d safetensors files, %d .npy files, manifest in %s"
          % (len(manifest["tensors"]), len({e["file"] for e in manifest["tensors"]}), len(manifest["npy"]), out))


# ---- check: files written by the C++ test ----

def first_difference(got, want):
    diff = np.argwhere(got != want)
    return tuple(int(i) for i in diff[0]) if len(diff) else None


def expect_bits(label, got_bits, want_bits, source):
    if got_bits.shape != want_bits.shape:
        raise Mismatch("%s: shape %s, expected %s" % (label, got_bits.shape, want_bits.shape))
    where = first_difference(got_bits, want_bits)
    if where is not None:
        raise Mismatch("%s: element %s has bits 0x%x, expected 0x%x (source value %r)"
                       % (label, where, int(got_bits[where]), int(want_bits[where]), float(source[where])))


def stored_bits(dtype, raw, shape):
    code = {"F32": "<u4", "F64": "<u8", "F16": "<u2", "BF16": "<u2"}[dtype]
    return np.frombuffer(raw, dtype=code).reshape(shape)


def expected_bits(dtype, source):
    """The bits a correct writer stores for `source` (float32 or float64) in `dtype`."""
    if dtype == "F32":
        return source.astype(np.float32).view(np.uint32)
    if dtype == "F64":
        return source.astype(np.float64).view(np.uint64)
    if dtype == "F16":
        # numpy rounds float32 and float64 to half directly (nearest-even); checked against the search.
        by_numpy = source.astype(np.float16).view(np.uint16)
        if not np.array_equal(by_numpy, f16_bits_from_f64(source.astype(np.float64))):
            raise Mismatch("numpy's float16 rounding disagrees with the nearest-value search")
        return by_numpy
    if source.dtype == np.float32:
        by_bits = bf16_bits_from_f32(source)
        if not np.array_equal(by_bits, bf16_bits_from_f64(source.astype(np.float64))):
            raise Mismatch("the two bf16 roundings (integer RNE, nearest-value search) disagree")
        return by_bits
    return bf16_bits_from_f64(source)


def check_tensor(path, tensors, name, dtype, source):
    if name not in tensors:
        raise Mismatch("%s: no tensor %r (has %s)" % (path, name, sorted(tensors)))
    got_dtype, shape, raw = tensors[name]
    if got_dtype != dtype:
        raise Mismatch("%s: tensor %r is %s, expected %s" % (path, name, got_dtype, dtype))
    if as_table(np.zeros(shape)).shape != source.shape:
        raise Mismatch("%s: tensor %r has shape %s, source %s" % (path, name, shape, source.shape))
    expect_bits("%s: %s" % (os.path.basename(path), name), as_table(stored_bits(dtype, raw, shape)),
                expected_bits(dtype, source), source)


def check(root):
    cpp = os.path.join(root, "cpp")
    with open(os.path.join(cpp, "written.json")) as f:
        written = json.load(f)
    checked = 0
    for entry in written["checkpoints"]:
        path = os.path.join(cpp, entry["file"])
        tensors, metadata = read_safetensors(path)
        if metadata.get("format") != "pt" or metadata.get("embedhead.tied") != ("true" if entry["tied"] else "false"):
            raise Mismatch("%s: metadata %r" % (path, metadata))
        if set(tensors) != set(entry["tensors"]):
            raise Mismatch("%s: tensors %s, expected %s" % (path, sorted(tensors), sorted(entry["tensors"])))
        for name, source_file in entry["tensors"].items():
            source = np.load(os.path.join(cpp, source_file))
            if source.dtype != np.float32:
                raise Mismatch("%s: expected a float32 source, got %s" % (source_file, source.dtype))
            check_tensor(path, tensors, name, entry["dtype"], source)
            checked += 1
    for entry in written["from_double"]:
        path = os.path.join(cpp, entry["file"])
        tensors, _ = read_safetensors(path)
        source = np.load(os.path.join(cpp, entry["source"]))
        if source.dtype != np.float64:
            raise Mismatch("%s: expected a float64 source, got %s" % (entry["source"], source.dtype))
        for name, dtype in entry["tensors"].items():
            check_tensor(path, tensors, name, dtype, source)
            checked += 1
        # The sources include values where rounding to float32 first and then to bf16 / f16 gives
        # a different answer than one rounding: the check above would catch a double rounding.
        traps = np.array(entry["double_rounding_traps"])
        flat = source.reshape(-1)[traps]
        if np.array_equal(bf16_bits_from_f32(flat.astype(np.float32)), bf16_bits_from_f64(flat)):
            raise Mismatch("the bf16 trap values do not discriminate double rounding")
        if np.array_equal(f16_bits_from_f64(flat.astype(np.float32).astype(np.float64)), f16_bits_from_f64(flat)):
            raise Mismatch("the f16 trap values do not discriminate double rounding")
    for entry in written["npy"]:
        path = os.path.join(cpp, entry["file"])
        array = np.load(path)
        want = numpy_pattern(entry["rows"], entry["cols"], np.dtype(entry["dtype"]))
        if array.dtype != want.dtype or array.shape != want.shape or not np.array_equal(array, want):
            raise Mismatch("%s: numpy.load gives %s %s, expected %s %s" % (path, array.dtype, array.shape,
                                                                         want.dtype, want.shape))
        buffer = io.BytesIO()
        np.save(buffer, want)
        with open(path, "rb") as f:
            if f.read() != buffer.getvalue():
                raise Mismatch("%s: bytes differ from numpy.save's" % path)
        checked += 1
    if checked < 12:
        raise Mismatch("only %d items checked; the C++ test wrote too little" % checked)
    print("check: %d tensors and .npy files written by C++ match numpy bit for bit" % checked)


def main(argv):
    if len(argv) != 3 or argv[1] not in ("generate", "check"):
        sys.stderr.write(__doc__)
        return 2
    try:
        with np.errstate(over="ignore"):  # casts to +-inf on overflow are expected (and checked)
            (generate if argv[1] == "generate" else check)(argv[2])
    except Mismatch as e:
        sys.stderr.write("MISMATCH: %s\n" % e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
