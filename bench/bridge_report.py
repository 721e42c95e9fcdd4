#!/usr/bin/env python3
"""bench/bridge.py's output: the markdown table of TTFT native vs bridged by prompt length, and the
PNG plot (Pillow) of it with the floor."""

from __future__ import annotations

import sys
from pathlib import Path


def fmt(x, nd=1):
    return "—" if x is None else f"{x:,.{nd}f}"


def table(lengths: list[dict]) -> str:
    head = ("| target | prompt tok | native TTFT s | bridged TTFT s | speedup | prefill engine s (tok/s) "
            "| bridge overhead s | floor 10 GbE s | tail tok (s) | mid-block bridged TTFT s (tail tok) "
            "| decode tok/s native / bridged | payload B/tok |")
    lines = [head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"]
    for L in lengths:
        n, b, m = L.get("native"), L.get("bridged"), L.get("midblock")
        tail = None
        if b:
            tail_s = b["stages_s"].get("engine_prefill")
            tail = f"{b['tail_tokens']} ({fmt(tail_s, 2)})"
        mid = f"{fmt(m['ttft_s'])} ({m['tail_tokens']})" if m else "—"
        pe = f"{fmt(b['prefill_engine_s'], 2)} ({fmt(b['prefill_engine_tok_s'], 0)})" if b else "—"
        lines.append(
            f"| {L['target']:,} | {fmt(L.get('prompt_tokens'), 0)} | {fmt(n and n['ttft_s'])} | {fmt(b and b['ttft_s'], 2)} "
            f"| {fmt(L.get('speedup'))}× | {pe} | {fmt(b and b['bridge_overhead_s'], 2)} | {fmt(b and b['floor_s'], 2)} "
            f"| {tail or '—'} | {mid} | {fmt(n and n['decode_tok_s'])} / {fmt(b and b['decode_tok_s'])} "
            f"| {fmt(b and b['payload_bytes_per_token'], 0)} |"
        )
    return "\n".join(lines)


def plot(lengths: list[dict], path: Path, title: str) -> bool:
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        print("Pillow is not available: no PNG", file=sys.stderr)
        return False
    series = [
        ("native (decoder prefills itself)", (200, 50, 40), "native", "ttft_s", False),
        ("bridged (blocks aligned, tail ~1 token)", (40, 90, 200), "bridged", "ttft_s", False),
        ("bridged, mid-block prompt (+B/2 tail)", (120, 170, 240), "midblock", "ttft_s", False),
        ("floor: max(prefill engine, bytes / 10 GbE)", (30, 150, 60), "bridged", "floor_s", True),
    ]
    pts = {}
    for name, color, kind, field, dashed in series:
        p = [(r["prompt_tokens"], r[field]) for L in lengths if (r := L.get(kind)) and r.get(field) is not None]
        if p:
            pts[name] = (color, dashed, p)
    if not pts:
        return False
    W, H = 1000, 660
    ml, mr, mt, mb = 90, 30, 60, 130
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    try:
        font = ImageFont.load_default(size=15)
        small = ImageFont.load_default(size=13)
    except TypeError:
        font = small = ImageFont.load_default()
    import math
    xmax = max(x for _, _, p in pts.values() for x, _ in p) * 1.08
    ys_all = [y for _, _, p in pts.values() for _, y in p if y > 0]
    # Log scale in y: the ratio between two curves (the speedup) is the vertical gap between them.
    lo = 10 ** math.floor(math.log10(min(ys_all) / 1.3))
    hi = 10 ** math.ceil(math.log10(max(ys_all) * 1.3))
    step = 512 if xmax <= 6000 else 1024 * math.ceil(xmax / 8192)
    X = lambda x: ml + (W - ml - mr) * x / xmax
    Y = lambda y: H - mb - (H - mt - mb) * (math.log10(max(y, lo)) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
    for gx in range(0, int(xmax) + 1, step):
        d.line([(X(gx), mt), (X(gx), H - mb)], fill=(230, 230, 230))
        d.text((X(gx), H - mb + 8), f"{gx:,}", fill="black", font=small, anchor="ma")
    decade = lo
    while decade <= hi:
        for k in (1, 2, 5):
            gy = decade * k
            if lo <= gy <= hi:
                d.line([(ml, Y(gy)), (W - mr, Y(gy))], fill=(215, 215, 215) if k == 1 else (238, 238, 238))
                d.text((ml - 8, Y(gy)), f"{gy:g}", fill="black", font=small, anchor="rm")
        decade *= 10
    d.rectangle([ml, mt, W - mr, H - mb], outline="black")
    d.text((W / 2, 20), title, fill="black", font=font, anchor="ma")
    d.text(((ml + W - mr) / 2, H - mb + 32), "prompt tokens", fill="black", font=font, anchor="ma")
    d.text((20, mt - 30), "time to first token, s (log scale)", fill="black", font=font)
    for name, (color, dashed, p) in pts.items():
        p = sorted(p)
        for (x0, y0), (x1, y1) in zip(p, p[1:]):
            if dashed:
                n = 24
                for i in range(0, n, 2):
                    a, b = i / n, (i + 1) / n
                    d.line([(X(x0 + (x1 - x0) * a), Y(y0 + (y1 - y0) * a)),
                            (X(x0 + (x1 - x0) * b), Y(y0 + (y1 - y0) * b))], fill=color, width=3)
            else:
                d.line([(X(x0), Y(y0)), (X(x1), Y(y1))], fill=color, width=3)
        for x, y in p:
            d.ellipse([X(x) - 5, Y(y) - 5, X(x) + 5, Y(y) + 5], fill=color)
            if not dashed:
                d.text((X(x) + 8, Y(y) - 6), f"{y:.1f}", fill=color, font=small, anchor="ld")
            else:
                d.text((X(x) + 8, Y(y) + 6), f"{y:.1f}", fill=color, font=small, anchor="la")
    # The legend, in two columns under the plot.
    for i, (name, (color, dashed, _)) in enumerate(pts.items()):
        lx, ly = ml + (i % 2) * 440, H - mb + 62 + (i // 2) * 22
        d.line([(lx, ly + 7), (lx + 35, ly + 7)], fill=color, width=3)
        d.text((lx + 43, ly), name, fill="black", font=small)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return True
