#!/usr/bin/env python3
"""Renders an embedhead-inspect HTML report in headless Chromium and checks what a reader sees.

usage: browser_check.py --inspect BIN --chromium BIN --out DIR -- <embedhead-inspect arguments>

1. runs  BIN <arguments> --html DIR/report.html --svg DIR/figure
2. chromium --headless --dump-dom: the rendered DOM must hold the title, the three figures
   (svg#fig-norms, svg#fig-centroid, svg#fig-pca), each with a title, tick labels and axis labels,
   histogram bars (rect.bar) in both histograms, one circle.pt per shown token in the scatter (as
   many as the subtitle says), the highlighted candidates (circle.pt-cand, rect.bar-cand), the
   summary and candidate tables, and no <script> or external resource;
3. chromium --headless --screenshot at 1200x1600: the PNG must be 1200x1600 and not blank: enough
   non-white pixels, and pixels of both the token blue and the candidate orange.

Only python3's standard library plus numpy (for the PNG pixels).
"""
import argparse
import html.parser
import os
import re
import struct
import subprocess
import sys
import zlib

import numpy as np

WIDTH, HEIGHT = 1200, 1600
failures = []


def check(condition, message):
    print(("ok    " if condition else "FAIL  ") + message)
    if not condition:
        failures.append(message)


class Dom(html.parser.HTMLParser):
    """Collects elements (tag, attrs, parent svg id) and the text of <h1> and <text>."""

    def __init__(self):
        super().__init__()
        self.elements = []
        self.svg = None
        self.stack = []
        self.texts = []  # (svg id, class, text)
        self.h1 = ""

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg":
            self.svg = a.get("id")
        self.elements.append((tag, a, self.svg))
        self.stack.append((tag, a))

    def handle_endtag(self, tag):
        while self.stack:
            t, _ = self.stack.pop()
            if t == tag:
                break
        if tag == "svg":
            self.svg = None

    def handle_data(self, data):
        if not self.stack:
            return
        tag, a = self.stack[-1]
        if tag == "h1":
            self.h1 += data
        elif tag == "text":
            self.texts.append((self.svg, a.get("class", ""), data))

    def count(self, tag, cls=None, svg=None):
        return sum(1 for t, a, s in self.elements
                   if t == tag and (cls is None or cls in a.get("class", "").split()) and (svg is None or s == svg))


def run(cmd, **kw):
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=False, **kw)


def chromium_cmd(chromium, *extra):
    return [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--hide-scrollbars", "--no-first-run", "--disable-extensions", *extra]


def png_pixels(path):
    """Decodes an 8-bit RGB or RGBA, non-interlaced PNG into an [H, W, C] uint8 array."""
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    if depth != 8 or colour not in (2, 6) or interlace != 0:
        raise ValueError(f"unsupported PNG: depth {depth}, colour type {colour}, interlace {interlace}")
    channels = 3 if colour == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8)
    stride = width * channels
    rows = raw.reshape(height, stride + 1)
    out = np.zeros((height, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.int32)
    for y in range(height):
        f, line = rows[y, 0], rows[y, 1:].astype(np.int32)
        if f == 0:
            cur = line
        elif f == 1:  # Sub: a running sum per channel
            cur = np.cumsum(line.reshape(width, channels), axis=0).reshape(-1) & 0xFF
        elif f == 2:  # Up
            cur = (line + prev) & 0xFF
        elif f in (3, 4):  # Average, Paeth: sequential in x
            cur = np.zeros(stride, dtype=np.int32)
            for x in range(stride):
                a = cur[x - channels] if x >= channels else 0
                b = prev[x]
                if f == 3:
                    cur[x] = (line[x] + ((a + b) >> 1)) & 0xFF
                else:
                    c = prev[x - channels] if x >= channels else 0
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                    cur[x] = (line[x] + pred) & 0xFF
        else:
            raise ValueError(f"bad filter {f} in row {y}")
        out[y] = cur
        prev = cur
    return (width, height), out.reshape(height, width, channels)[:, :, :3]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--inspect", required=True)
    parser.add_argument("--chromium", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    o = parser.parse_args()
    args = [a for a in o.args if a != "--"]
    os.makedirs(o.out, exist_ok=True)
    report = os.path.abspath(os.path.join(o.out, "report.html"))
    shot = os.path.join(o.out, "report.png")
    for stale in (report, shot):
        if os.path.exists(stale):
            os.remove(stale)

    r = run([o.inspect, *args, "--html", report, "--svg", os.path.join(o.out, "figure")])
    check(r.returncode == 0, f"embedhead-inspect exits with 0 (got {r.returncode})")
    check(os.path.exists(report), "the report was written")
    if failures:
        return 1
    source = open(report, encoding="utf-8").read()
    check(not re.search(r"<script|<link|<img|<iframe|src=|@import|url\(", source, re.I),
          "the report has no script and no external resource")
    for name in ("norms", "centroid", "pca"):
        check(os.path.getsize(os.path.join(o.out, f"figure-{name}.svg")) > 1000, f"figure-{name}.svg written")

    url = "file://" + report
    r = run(chromium_cmd(o.chromium, "--dump-dom", url), capture_output=True, text=True, timeout=120)
    check(r.returncode == 0 and "<html" in r.stdout, f"chromium --dump-dom succeeds (status {r.returncode})")
    if r.returncode != 0:
        print(r.stderr[-3000:])
        return 1
    dom = Dom()
    dom.feed(r.stdout)
    title = re.search(r"<title>(.*?)</title>", source).group(1)
    check(dom.h1.strip() == title and title, f"the page title is shown as <h1>: {dom.h1.strip()!r}")
    ids = [a.get("id") for t, a, _ in dom.elements if t == "svg"]
    check(ids == ["fig-norms", "fig-centroid", "fig-pca"], f"three figures in order, got {ids}")
    for fig in ("fig-norms", "fig-centroid", "fig-pca"):
        texts = [(c, s) for svg, c, s in dom.texts if svg == fig]
        check(any(c == "fig-title" and s.strip() for c, s in texts), f"{fig} has a title")
        check(sum(1 for c, _ in texts if c == "axis-label") == 2, f"{fig} has two axis labels")
        check(sum(1 for c, _ in texts if c == "tick") >= 6, f"{fig} has tick values")
    for fig in ("fig-norms", "fig-centroid"):
        bars = dom.count("rect", "bar", fig)
        check(10 <= bars <= 48, f"{fig} has histogram bars ({bars})")
        check(dom.count("rect", "bar-cand", fig) >= 1, f"{fig} highlights the candidates' bins")
    points = dom.count("circle", "pt", "fig-pca")
    cands = dom.count("circle", "pt-cand", "fig-pca")
    subtitle = " ".join(s for svg, c, s in dom.texts if svg == "fig-pca" and c == "fig-subtitle")
    m = re.search(r"(?:all|sample of) ([\d,]+) ", subtitle)
    expected = int(m.group(1).replace(",", "")) if m else -1
    check(points == expected, f"the scatter has one circle per shown token ({points}, subtitle says {expected})")
    rows = len(re.findall(r"<tr><td class=\"n\">", r.stdout))
    check(cands >= 1 and cands == rows, f"the scatter highlights every listed candidate ({cands} of {rows})")
    check(dom.count("circle", "legend-mark", "fig-pca") == 2, "the scatter has a two-entry legend")
    check(dom.count("table") == 2, "the summary and candidate tables are present")

    r = run(chromium_cmd(o.chromium, f"--screenshot={os.path.abspath(shot)}", f"--window-size={WIDTH},{HEIGHT}", url),
            capture_output=True, text=True, timeout=120)
    check(r.returncode == 0 and os.path.exists(shot), "chromium --screenshot writes a PNG")
    if failures:
        print(r.stderr[-3000:])
        return 1
    size, pixels = png_pixels(shot)
    check(size == (WIDTH, HEIGHT), f"the screenshot is {WIDTH}x{HEIGHT} (got {size[0]}x{size[1]})")
    check(os.path.getsize(shot) > 30000, f"the PNG is not trivially small ({os.path.getsize(shot)} bytes)")
    p = pixels.astype(np.int32)
    non_white = np.mean(np.any(p < 235, axis=2))
    check(non_white > 0.03, f"{100 * non_white:.1f}% of the pixels are not white (> 3%)")
    blue = np.sum((np.abs(p[:, :, 0] - 0x3B) < 40) & (np.abs(p[:, :, 1] - 0x6E) < 40) & (np.abs(p[:, :, 2] - 0xA8) < 40))
    orange = np.sum((p[:, :, 0] > 200) & (np.abs(p[:, :, 1] - 0x59) < 45) & (p[:, :, 2] < 70))
    check(blue > 2000, f"token-blue pixels are visible ({blue})")
    check(orange > 100, f"candidate-orange pixels are visible ({orange})")
    print(f"screenshot: {os.path.abspath(shot)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
