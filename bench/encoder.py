"""The vision encoder stage and its cache against encoding every image inline, on the real Gemma 3 270M.

    python bench/encoder.py [--json out.json] [--repeats 3] [--turns 6] [--users 6] [--preset small]

Two workloads of real text (engine.text.real_text) with pictures of real text (a "screenshot": documentation
rendered by Pillow), prompts built through the model's chat template with each image's placeholders:

* `agent`: one session of `--turns` turns; every turn's user message re-sends the same screenshot with the
  next tool result, so turn n's prompt holds n copies of it;
* `shared`: `--users` conversations of one tenant about the same product photo, each with its own question.

Each request is served two ways, in the same repeat, on fresh tenants:

* `inline`: the baseline. No store: every image is encoded in the prefill process, and every prompt computed.
* `stage`: the encoder process (`python -m engine.vision.server`, started here) encodes what the store lacks and
  saves it as an encoder record; prefill reads records, and loads the blocks the store holds (images are in
  the block identity, so the blocks after an image are reusable).

Per workload: TTFT (image encoding + prefill, summed over its requests), encoder seconds (inline encodes, and
the calls to the encoder process), the encoder records' hit rate, and the hit rate of blocks that lie after
an image (of the full blocks from the first image's block on, those loaded). Reported: medians over repeats
with min..max, and `ttft_ratio` / `encoder_ratio` = stage / inline. Weights of the tower are random: what is
measured is where the time goes, not what the model says about the pictures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from engine.prefill import PrefillConfig, PrefillEngine, PrefillRequest  # noqa: E402
from engine.prefill.request import PromptImage  # noqa: E402
from engine.text.chat_prompt import IMAGE_MARK, encode_chat, split_images  # noqa: E402
from engine.text.real_text import SYSTEM_REFERENCE, TOPICS, docstring, system_prompt  # noqa: E402
from engine.vision.client import EncoderClient  # noqa: E402
from engine.vision.images import DecodedImage, content_digest  # noqa: E402
from engine.vision.presets import VISION_PRESETS, vision_config  # noqa: E402
from engine.vision.stage import VisionStage  # noqa: E402
from engine.vision.tower import VisionTower  # noqa: E402
from kvstore.analytics.cli import progress  # noqa: E402
from kvstore.block import ImageSpan  # noqa: E402
from kvstore.client import ClientConfig, KVClient  # noqa: E402
from kvstore.server.process import DaemonProcess  # noqa: E402

MODES = ("inline", "stage")
REPLY = "I will look at the screen and pick the next function."


def picture(text: str, size: tuple[int, int] = (448, 448)) -> DecodedImage:
    """A screenshot of `text`: black type on white, as a terminal or a documentation page shows it."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    lines = [line for paragraph in text.splitlines() for line in textwrap.wrap(paragraph, 70) or [""]]
    for i, line in enumerate(lines[: size[1] // 12]):
        draw.text((6, 4 + 12 * i), line, fill="black")
    rgb = np.asarray(image, dtype=np.uint8)
    return DecodedImage(content_digest(rgb), rgb)


@dataclass
class Request:
    messages: list[dict]
    images: list[DecodedImage]
    session: str


def agent_requests(turns: int) -> list[Request]:
    screen = picture(docstring("os.path.join") + "\n\n" + docstring("json.dumps"))
    messages: list[dict] = [{"role": "system", "content": system_prompt(3)}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{IMAGE_MARK}\nTool result (help({TOPICS[turn]})):\n"
                                                    f"{docstring(TOPICS[turn])}\n\nWhat next?"})
        out.append(Request([dict(m) for m in messages], [screen] * (turn + 1), "agent"))
        messages.append({"role": "assistant", "content": REPLY})
    return out


def shared_requests(users: int) -> list[Request]:
    photo = picture("PRODUCT SHEET\n\n" + docstring(SYSTEM_REFERENCE[0]))
    system = {"role": "system", "content": system_prompt(3)}
    return [Request([system, {"role": "user", "content": f"{IMAGE_MARK}\nAbout the product in the photo: "
                                                         f"{docstring(TOPICS[u + 4])[:400]}"}],
                    [photo], f"user-{u}") for u in range(users)]


@dataclass
class Figures:
    ttft_s: float = 0.0
    encoder_s: float = 0.0
    records_hit: int = 0
    records_looked: int = 0
    blocks_after_image: int = 0
    blocks_after_image_loaded: int = 0
    requests: list[float] = field(default_factory=list)
    paths: Counter[str] = field(default_factory=Counter)  # the prefill's path of each request (cold, cached, ...)


def serve(requests: list[Request], engine: PrefillEngine, stage: VisionStage, tokenizer, salt: str,
          served: Callable[[], None]) -> Figures:
    figures = Figures()
    n = stage.tokens_per_image
    for request in requests:
        ids, starts = split_images(encode_chat(tokenizer, request.messages, image_tokens=n), n)
        counts, encoding_s = dict(stage.counts), stage.encode_seconds + stage.remote_seconds
        started = time.perf_counter()
        rows = stage.embeds(request.images, salt)
        vision_s = time.perf_counter() - started
        images = tuple(PromptImage(ImageSpan(start, n, image.digest), embeds)
                       for start, image, embeds in zip(starts, request.images, rows, strict=True))
        result = engine.prefill(PrefillRequest(ids, salt=salt, session_id=f"{salt}/{request.session}",
                                               images=images))
        result.kv.release()
        if engine.client is not None:
            engine.client.write_behind.flush()  # the next turn finds this one's blocks, as it would seconds later
        ttft = vision_s + result.ttft_s
        figures.paths[result.path] += 1
        served()
        figures.requests.append(ttft)
        figures.ttft_s += ttft
        figures.encoder_s += stage.encode_seconds + stage.remote_seconds - encoding_s
        figures.records_hit += stage.counts["store"] - counts.get("store", 0)
        figures.records_looked += len(request.images)
        B = engine.block_tokens
        first_block = starts[0] // B
        figures.blocks_after_image += len(ids) // B - first_block
        figures.blocks_after_image_loaded += max(result.loaded_tokens // B - first_block, 0)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--preset", default="small", choices=sorted(VISION_PRESETS))
    args = parser.parse_args(argv)

    from engine.checkpoints.real_model import load_real_model
    from engine.model.decoder import Decoder
    from engine.model.weights import model_identity

    folder, tokenizer = load_real_model()
    model = Decoder.from_pretrained(folder)
    tower = VisionTower.random(vision_config(args.preset, model.config.hidden_size))
    workloads = {"agent": agent_requests(args.turns), "shared": shared_requests(args.users)}
    with tempfile.TemporaryDirectory(prefix="bench-encoder-") as tmp:
        work = Path(tmp)
        daemon = DaemonProcess(work / "daemon", work).start()
        encoder = subprocess.Popen([sys.executable, "-m", "engine.vision.server", "--text-hidden",
                                    str(model.config.hidden_size), "--vision-preset", args.preset, "--servers",
                                    daemon.address, "--exit-on-stdin-eof"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        try:
            ready = encoder.stdout.readline() if encoder.stdout is not None else ""
            if not ready.startswith("READY "):
                raise SystemExit(f"the encoder process did not start: {ready!r}")
            remote = EncoderClient(f"127.0.0.1:{ready.split()[1]}")
            with KVClient(ClientConfig(servers=(daemon.address,))) as client:
                config = PrefillConfig(kv_pages=256)
                stored = PrefillEngine(model, client, config, model_identity(folder))
                engines = {"inline": PrefillEngine(model, None, PrefillConfig(kv_pages=256, cost=stored.cost),
                                                   model_identity(folder)), "stage": stored}
                results: dict[str, dict[str, list[Figures]]] = {w: {m: [] for m in MODES} for w in workloads}
                bar = progress("encoder bench", args.repeats * len(MODES) * sum(map(len, workloads.values())))
                done = 0

                def served() -> None:
                    nonlocal done
                    done += 1
                    bar(done)

                for repeat in range(args.repeats):
                    for name, requests in workloads.items():
                        for mode in MODES:  # interleaved: both see the same machine state
                            stage = VisionStage(tower, client if mode == "stage" else None,
                                                remote if mode == "stage" else None)
                            results[name][mode].append(serve(requests, engines[mode], stage, tokenizer,
                                                             f"{name}-{mode}-{repeat}-{time.time_ns()}", served))
            remote.close()
        finally:
            if encoder.stdin is not None:
                encoder.stdin.close()
            encoder.wait(30)
            daemon.stop()
    report = summarize(results)
    for line in report.pop("lines"):
        print(line)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _stat(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(results: dict[str, dict[str, list[Figures]]]) -> dict:
    report: dict = {"lines": []}
    lines = report["lines"]
    for name, modes in results.items():
        out = report[name] = {}
        for mode, runs in modes.items():
            out[mode] = {
                "ttft_s": _stat([r.ttft_s for r in runs]),
                "encoder_s": _stat([r.encoder_s for r in runs]),
                "encoder_record_hit_rate": _stat([r.records_hit / r.records_looked for r in runs]),
                "block_hit_rate_after_image": _stat([r.blocks_after_image_loaded / r.blocks_after_image
                                                     for r in runs]),
                "prefill_paths": dict(sum((r.paths for r in runs), Counter())),
            }
        for what in ("ttft_s", "encoder_s"):
            ratios = [getattr(s, what) / getattr(i, what) for s, i in zip(modes["stage"], modes["inline"])
                      if getattr(i, what) > 0]
            out[what.removesuffix("_s") + "_ratio"] = _stat(ratios)
        stage, inline = out["stage"], out["inline"]
        ours, theirs = stage["ttft_s"], inline["ttft_s"]
        lines.append(f"{name}: TTFT summed over its requests, stage {ours['median']:.2f} s ({ours['min']:.2f}.."
                     f"{ours['max']:.2f}) vs inline {theirs['median']:.2f} s ({theirs['min']:.2f}..{theirs['max']:.2f})"
                     f": ratio {out['ttft_ratio']['median']:.2f} ({out['ttft_ratio']['min']:.2f}.."
                     f"{out['ttft_ratio']['max']:.2f})")
        lines.append(f"{name}: encoder seconds, stage {stage['encoder_s']['median']:.3f} vs inline "
                     f"{inline['encoder_s']['median']:.3f}: ratio {out['encoder_ratio']['median']:.2f}")
        lines.append(f"{name}: encoder records hit {stage['encoder_record_hit_rate']['median']:.0%}, blocks after "
                     f"an image loaded {stage['block_hit_rate_after_image']['median']:.0%} (inline: "
                     f"{inline['block_hit_rate_after_image']['median']:.0%}); prefill paths {stage['prefill_paths']}")
    return report


if __name__ == "__main__":
    sys.exit(main())
