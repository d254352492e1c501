"""The OpenAI chat-completions request, checked into a :class:`ChatRequest`, and its errors.

What is accepted (docs/serving.md#requests): one user message, its content a string or a list
of ``text`` and at most one ``image_url`` part (a ``data:`` URI; a file path only under
``--local-images``); an optional system message is refused rather than silently dropped, as
are earlier turns, since the model has no chat template for them. ``stream`` (with
``stream_options.include_usage``), ``stop`` (up to 4 strings), ``temperature`` (0: greedy),
``top_p`` and ``seed`` are honoured; ``n`` other than 1, penalties, ``best_of``, ``echo``,
``logprobs``, tools and response formats are refused with a 400 naming the field. Extensions:
``latency_budget_ms`` (positive, finite), ``knobs`` (fixed max_crops / top_k /
num_active_blocks instead of the controller's choice) and ``when_unreachable`` (``refuse``, the
default, or ``run``: what the server does with a request whose budget the queue ahead leaves no
room for, docs/serving.md#overload). A request without ``latency_budget_ms`` may state its budget
as a gateway does, in the Gateway API Inference Extension's objective headers
(:func:`slo_budget_ms`).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import unquote, urlparse

from PIL import Image, PngImagePlugin, UnidentifiedImageError

from pipeline.options import option_default
from pipeline.parse import RepeatedKeyError, loads_unique_keys
from serve.config import ServeConfig

#: what a request may ask the server to do when the queue ahead leaves its budget no room
WHEN_UNREACHABLE = ("refuse", "run")
#: the Gateway API Inference Extension's latency objectives of a request, in milliseconds
SLO_TTFT_HEADER, SLO_TPOT_HEADER = "x-slo-ttft-ms", "x-slo-tpot-ms"
#: knob names a request may fix in ``knobs``
KNOB_NAMES = ("max_crops", "top_k", "num_active_blocks")
#: ``metadata``: the most pairs, the longest key and the longest value (OpenAI's limits)
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
#: the most stop sequences a request may give (OpenAI's limit), and the longest one
MAX_STOP = 4
MAX_STOP_CHARS = 256
#: the most JSON values a request body may spell outside its strings (commas, ``[`` and ``{``):
#: a chat request needs a few dozen, and what parsing holds grows with them, not with the bytes
MAX_JSON_VALUES = 10_000


class RequestError(Exception):
    """A request the server refuses: HTTP status, one-line message, the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def error_type(self) -> str:
        return {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
                429: "rate_limit_error", 500: "server_error", 503: "server_overloaded",
                504: "timeout_error"}.get(self.status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        """The OpenAI error object."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """One checked request: the question, the image (RGB, or None), the generation and budget settings."""

    model: str
    question: str
    image: Image.Image | None
    max_tokens: int
    budget_ms: float | None
    knobs: dict[str, int] | None = None
    #: reply as server-sent events (``stream``), with a last chunk of token counts (``stream_options.include_usage``)
    stream: bool = False
    include_usage: bool = False
    #: generation ends at the first of these in the text, which is cut before it
    stop: tuple[str, ...] = ()
    #: 0: greedy; else sampled at this temperature from the top_p nucleus, seeded by ``seed`` when given
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    #: refuse (503) or run at the cheapest configuration a request the queue ahead leaves no room for
    when_unreachable: str = "refuse"
    #: the client's own labels (OpenAI's ``metadata``), recorded in the request log
    metadata: dict[str, str] | None = None


@dataclass(frozen=True)
class Limits:
    """What a request may ask for (from :class:`serve.config.ServeConfig`)."""

    default_max_tokens: int
    max_tokens_limit: int
    max_image_pixels: int
    local_images: Path | None = None
    #: the served model answers only questions about an image (``ModelRuntime.answers_without_image``)
    image_required: bool = False
    #: the most characters of question text (the prefill's cost grows with it, quadratically)
    max_prompt_chars: int = option_default(ServeConfig, "max_prompt_chars")
    #: the most tokens of the formatted prompt (None: no limit; the server sets the model's context length)
    max_prompt_tokens: int | None = None
    #: the largest image file read from ``local_images`` (a data: URI meets the body's limit instead)
    max_image_file_bytes: int = option_default(ServeConfig, "max_body_bytes")
    #: the most the longer side of an image may be of its shorter side
    max_image_aspect: float = option_default(ServeConfig, "max_image_aspect")
    #: texts the model's tokenizer reads as its own control tokens (a question must not spell them)
    reserved_texts: tuple[str, ...] = ()


def _refuse(message: str, param: str | None = None, code: str | None = "invalid_value") -> NoReturn:
    """Raise the 400 :class:`RequestError` of a bad field."""
    raise RequestError(400, message, param, code)


def parse_json_body(body: bytes) -> Any:
    """The request body's JSON value; a 400 naming the reason for a body that is not valid UTF-8,
    not JSON, nested too deeply, or that names a key twice in one object (which value is meant
    would be a guess: a second ``messages`` would silently replace the first)."""
    if body[:4].count(0) or body[:2] in (b"\xff\xfe", b"\xfe\xff"):  # JSON starts with ASCII: a NUL is UTF-16/32
        _refuse("the request body is not UTF-8 (it reads as UTF-16 or UTF-32): send the JSON encoded as UTF-8", None,
                "invalid_json")
    values = json_value_count(body, MAX_JSON_VALUES)
    if values > MAX_JSON_VALUES:
        _refuse(f"the request body spells more than {MAX_JSON_VALUES:,} JSON values (array and object elements, "
                "outside strings): a chat request needs a few dozen", None, "too_many_values")
    try:
        return loads_unique_keys(body)
    except RepeatedKeyError as exc:
        _refuse(f"the request body names {_shown(exc.key)} twice in one object: which value is meant is "
                "ambiguous", exc.key, "duplicate_key")
    except RecursionError:
        _refuse("the request body is nested too deeply to be a chat request", None, "invalid_json")
    except ValueError as exc:
        try:  # the parsers' own words for bad UTF-8 ("surrogates not allowed") mislead: name the byte
            body.decode("utf-8")
        except UnicodeDecodeError as bad:
            _refuse(f"the request body is not valid UTF-8 (byte {bad.start}: {bad.reason})", None, "invalid_json")
        _refuse(f"the request body is not valid JSON ({exc})", None, "invalid_json")


def json_value_count(body: bytes, limit: int) -> int:
    """A count of the commas, ``[`` and ``{`` of ``body`` (what bounds the values a parser builds:
    each value but the first of an array or object follows a comma) that is above ``limit``
    exactly when those outside its JSON strings are. Those of the whole body where they are few (a
    data URI has none); otherwise the strings are found, at most ``2 * limit`` of them, and those
    outside them counted until they exceed ``limit``."""
    total = body.count(b",") + body.count(b"[") + body.count(b"{")
    if total <= limit:
        return total
    plain = body.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in body else body  # escapes out
    if plain.count(b'"') > 2 * (limit + 1):  # more strings than values allowed: more values than that too
        return limit + 1
    count, start, inside = 0, 0, False
    while True:
        quote = plain.find(b'"', start)
        end = len(plain) if quote < 0 else quote
        if not inside:
            count += plain.count(b",", start, end) + plain.count(b"[", start, end) + plain.count(b"{", start, end)
            if count > limit:
                return count
        if quote < 0:
            return count
        inside, start = not inside, quote + 1


def parse_chat_request(body: Any, limits: Limits) -> ChatRequest:
    """Check a decoded JSON body; raise :class:`RequestError` (400) naming the first bad field."""
    if not isinstance(body, dict):
        _refuse(f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        _refuse("`model` is required: a string (GET /v1/models lists the served model)", "model")
    decoding = _decoding(body)
    question, image = _read_messages(body.get("messages"), limits)
    if image is None and limits.image_required:
        _refuse(f"`messages[0].content` has no image: the model {_shown(model)} was trained only on questions about an "
                "image and answers noise without one; add an image_url part", "messages[0].content",
                "image_required")
    return ChatRequest(model=model, question=question, image=image, max_tokens=_max_tokens(body, limits),
                       budget_ms=_budget(body), knobs=_knobs(body.get("knobs")),
                       when_unreachable=_when_unreachable(body), metadata=_metadata(body.get("metadata")),
                       **decoding)


def _decoding(body: dict[str, Any]) -> dict[str, Any]:
    """The decoding and reply fields of :class:`ChatRequest` (``stream`` .. ``seed``); a 400 naming the
    first one refused."""
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1),
                          ("n", 1), ("best_of", 1)):
        got = body.get(name)
        if got is not None and (isinstance(got, bool) or not isinstance(got, int | float) or got != neutral):
            _refuse(f"`{name}` is not supported by this server: must be {neutral} or absent, got {_shown(got)}",
                    name, "unsupported_value")
    for name in ("logprobs", "echo"):
        if body.get(name) not in (None, False):
            _refuse(f"`{name}` is not supported by this server: must be false or absent", name, "unsupported_value")
    for name in ("logit_bias", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
                 "response_format", "top_logprobs"):
        if body.get(name) not in (None, [], {}):
            _refuse(f"`{name}` is not supported by this server: leave it out", name, "unsupported_value")
    stream = body.get("stream")
    if stream not in (None, True, False):
        _refuse(f"`stream` must be true or false, got {_shown(stream)}", "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if stream is not True:
            _refuse("`stream_options` is only allowed with `stream: true`", "stream_options")
        if not isinstance(options, dict):
            _refuse(f"`stream_options` must be an object, got {_shown(options)}", "stream_options")
        include_usage = options.get("include_usage")
        if include_usage not in (None, True, False):
            _refuse(f"`stream_options.include_usage` must be true or false, got {_shown(include_usage)}",
                    "stream_options.include_usage")
    return {"stream": stream is True, "include_usage": include_usage is True, "stop": _stop(body.get("stop")),
            "temperature": _number(body, "temperature", 0.0, 2.0, low_open=False, default=0.0),
            "top_p": _number(body, "top_p", 0.0, 1.0, low_open=True, default=1.0), "seed": _seed(body.get("seed"))}


def _number(body: dict[str, Any], name: str, low: float, high: float, *, low_open: bool, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    bad = isinstance(value, bool) or not isinstance(value, int | float) or not _finite(value)
    if bad or not (low < value if low_open else low <= value) or value > high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        _refuse(f"`{name}` must be a number in {interval}, got {_shown(value)}", name)
    return float(value)


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not -(2**63) <= value < 2**63:
        _refuse(f"`seed` must be a 64-bit integer, got {_shown(value)}", "seed")
    return int(value)


def _stop(value: Any) -> tuple[str, ...]:
    """The stop sequences: a string or a list of up to ``MAX_STOP`` non-empty strings (OpenAI's rule)."""
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP:
        _refuse(f"`stop` must be a string or a list of at most {MAX_STOP} strings, got {_shown(value)}", "stop")
    for i, stop in enumerate(stops):
        where = "stop" if isinstance(value, str) else f"stop[{i}]"
        if not isinstance(stop, str) or not stop:
            _refuse(f"`{where}` must be a non-empty string, got {_shown(stop)}", where)
        if len(stop) > MAX_STOP_CHARS:  # each is looked for, and held back while streaming, at every token
            _refuse(f"`{where}` has {len(stop):,} characters, more than the server's limit of {MAX_STOP_CHARS}",
                    where)
        _unicode(stop, where)
    return tuple(dict.fromkeys(stops))


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond any float
        return False


def _shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` for a one-line error, cut to ``limit`` characters."""
    try:
        text = repr(value)
    except ValueError:  # an integer with more digits than Python converts
        text = f"an integer of more than {limit} digits"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _max_tokens(body: dict[str, Any], limits: Limits) -> int:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return limits.default_max_tokens
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limits.max_tokens_limit:
        _refuse(f"`{name}` must be an integer in 1..{limits.max_tokens_limit}, got {_shown(value)}", name)
    return value


def _budget(body: dict[str, Any]) -> float | None:
    value = body.get("latency_budget_ms")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not _finite(value) or value <= 0:
        _refuse(f"`latency_budget_ms` must be a positive, finite number of milliseconds, got {_shown(value)}",
                   "latency_budget_ms")
    return float(value)


def slo_budget_ms(headers: Mapping[str, str], max_tokens: int) -> float | None:
    """The latency budget a request's objective headers state, or None without them.

    ``x-slo-ttft-ms`` (time to the first token) bounds stage 1, the prefill and stage 2; each of the
    other ``max_tokens - 1`` tokens may take ``x-slo-tpot-ms`` (time per output token). A request
    that meets ``ttft + tpot x (max_tokens - 1)`` end to end, the budget the controller reads, has
    met both on average; without ``x-slo-tpot-ms`` the budget is the ttft alone (the whole answer
    by the first token's deadline). ``x-slo-tpot-ms`` alone is refused: it says nothing of the
    prefill. A body's ``latency_budget_ms`` takes precedence over both."""
    values = {}
    for name in (SLO_TTFT_HEADER, SLO_TPOT_HEADER):
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            value = float(raw.strip())
        except ValueError:
            value = math.nan
        if not (_finite(value) and value > 0):
            _refuse(f"header {name} must be a positive, finite number of milliseconds, got {raw[:40]!r}", name)
        values[name] = value
    if not values:
        return None
    if SLO_TTFT_HEADER not in values:
        _refuse(f"header {SLO_TPOT_HEADER} needs {SLO_TTFT_HEADER} beside it: the budget is ttft + tpot x "
                "(max_tokens - 1)", SLO_TPOT_HEADER)
    return values[SLO_TTFT_HEADER] + values.get(SLO_TPOT_HEADER, 0.0) * max(int(max_tokens) - 1, 0)


def _when_unreachable(body: dict[str, Any]) -> str:
    value = body.get("when_unreachable", "refuse")
    if value not in WHEN_UNREACHABLE:
        _refuse(f"`when_unreachable` must be one of {', '.join(WHEN_UNREACHABLE)}, got {_shown(value)}",
                "when_unreachable")
    return value


def _metadata(value: Any) -> dict[str, str] | None:
    """OpenAI's ``metadata``: at most 16 string keys of at most 64 characters, each to a string of at most 512."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS:
        _refuse(f"`metadata` must be an object of at most {MAX_METADATA_PAIRS} string pairs, got {_shown(value)}",
                "metadata")
    for key, item in value.items():
        if not key or len(key) > MAX_METADATA_KEY:
            _refuse(f"`metadata` keys must have 1 to {MAX_METADATA_KEY} characters, got {_shown(key)}", "metadata")
        if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE:
            _refuse(f"`metadata.{key}` must be a string of at most {MAX_METADATA_VALUE} characters, got "
                    f"{_shown(item)}", f"metadata.{key}")
        _unicode(key, "metadata")
        _unicode(item, f"metadata.{key}")
    return {str(k): str(v) for k, v in value.items()} or None


def _knobs(value: Any) -> dict[str, int] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != set(KNOB_NAMES):
        _refuse(f"`knobs` must be an object with exactly {', '.join(KNOB_NAMES)} (integers), got {_shown(value)}",
                   "knobs")
    for name in KNOB_NAMES:
        if isinstance(value[name], bool) or not isinstance(value[name], int) or value[name] < 1:
            _refuse(f"`knobs.{name}` must be a positive integer, got {_shown(value[name])}", f"knobs.{name}")
    return {name: int(value[name]) for name in KNOB_NAMES}


def _read_messages(messages: Any, limits: Limits) -> tuple[str, Image.Image | None]:
    if not isinstance(messages, list) or not messages:
        _refuse("`messages` must be a non-empty list of messages", "messages")
    if len(messages) != 1 or not isinstance(messages[0], dict) or messages[0].get("role") != "user":
        roles = [m.get("role") if isinstance(m, dict) else type(m).__name__ for m in messages]
        _refuse(f"`messages` must hold exactly one user message (no system prompt, no earlier turns: the "
                   f"model has no chat template for them), got roles {roles}", "messages", "unsupported_value")
    content = messages[0].get("content")
    if isinstance(content, str):
        return _question(content, "messages[0].content", limits), None
    if not isinstance(content, list) or not content:
        _refuse("`messages[0].content` must be a string or a non-empty list of parts", "messages[0].content")
    texts: list[str] = []
    image: Image.Image | None = None
    for i, part in enumerate(content):
        where = f"messages[0].content[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                _refuse(f"`{where}.text` must be a string", f"{where}.text")
            texts.append(_unicode(part["text"], f"{where}.text"))
        elif kind == "image_url":
            if image is not None:
                _refuse(f"`{where}`: at most one image per request", where, "unsupported_value")
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                _refuse(f"`{where}.image_url.url` is required: a data: URI of the image", f"{where}.image_url")
            image = load_image(url, limits, f"{where}.image_url.url")
        else:
            _refuse(f"`{where}.type` must be 'text' or 'image_url', got {_shown(kind)}", f"{where}.type")
    return _question("\n".join(texts), "messages[0].content", limits), image


def _unicode(text: str, where: str) -> str:
    """``text``, refused when it holds a lone surrogate (JSON can spell one; UTF-8 cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        _refuse(f"`{where}` is not valid Unicode text: a lone surrogate {text[exc.start]!r} at character "
                f"{exc.start}", where)
    return text


def _question(text: str, where: str, limits: Limits) -> str:
    if len(text) > limits.max_prompt_chars:
        _refuse(f"`{where}` has {len(text):,} characters of text, more than the server's limit of "
                f"{limits.max_prompt_chars:,} (--max-prompt-chars)", where, "prompt_too_long")
    for reserved in limits.reserved_texts:
        if reserved in text:
            _refuse(f"`{where}` contains {reserved!r}, which the model reads as one of its control tokens (the image "
                    "placeholders, the end of text): leave it out of the question", where, "reserved_token")
    return _unicode(text, where)


def check_prompt_tokens(count: int, limits: Limits) -> None:
    """A 400 naming the count and the limit when the prompt has more than ``limits.max_prompt_tokens`` tokens."""
    if limits.max_prompt_tokens is not None and count > limits.max_prompt_tokens:
        _refuse(f"`messages[0].content` makes a prompt of {count:,} tokens, more than the server's limit of "
                f"{limits.max_prompt_tokens:,} (--max-prompt-tokens)", "messages[0].content", "prompt_too_long")


def load_image(url: str, limits: Limits, where: str) -> Image.Image:
    """The RGB image of a ``data:`` URI (or of a file under ``limits.local_images``)."""
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            _refuse(f"`{where}`: a data: URI must be base64 ('data:image/png;base64,...')", where)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            _refuse(f"`{where}`: the data: URI is not valid base64", where, "invalid_image")
        return decode_image(data, limits.max_image_pixels, where, limits.max_image_aspect)
    if limits.local_images is None:
        _refuse(f"`{where}`: only data: URIs are accepted (the server was not started with --local-images)",
                   where, "unsupported_value")
    parsed = urlparse(url)
    if parsed.scheme not in ("", "file"):
        _refuse(f"`{where}`: {parsed.scheme}: URLs are not fetched; send a data: URI or a file path", where,
                   "unsupported_value")
    if parsed.scheme == "file" and parsed.netloc.lower() not in ("", "localhost"):
        _refuse(f"`{where}`: a file: URL names host {_shown(parsed.netloc)}; only this machine's files are read "
                "(file:///path)", where, "unsupported_value")
    name = unquote(parsed.path) if parsed.scheme == "file" else url
    if "\x00" in name:
        _refuse(f"`{where}`: a file path must not contain a NUL character", where, "invalid_image")
    root = Path(limits.local_images).resolve()
    try:
        # the error messages name the path as the client spelled it: the resolved one may be a link's
        # target or a process's file, which are the server's to know
        path = Path(name)
        path = (path if path.is_absolute() else root / path).resolve()
        if not path.is_relative_to(root):
            _refuse(f"`{where}`: {_shown(name)} is outside the --local-images directory", where,
                    "unsupported_value")
        if not path.is_file():
            _refuse(f"`{where}`: no such image file {_shown(name)}", where, "invalid_image")
        size = path.stat().st_size
        if size > limits.max_image_file_bytes:
            _refuse(f"`{where}`: the image file has {size:,} bytes, more than the server's limit of "
                    f"{limits.max_image_file_bytes:,}", where, "image_too_large")
        data = path.read_bytes()
    except OSError as exc:  # a name too long, a file that vanished or cannot be read
        _refuse(f"`{where}`: cannot read the image file ({exc.strerror or type(exc).__name__})", where,
                "invalid_image")
    return decode_image(data, limits.max_image_pixels, where, limits.max_image_aspect)


def warm_image_decoding() -> None:
    """Decode a tiny PNG and JPEG once, so that the first request does not pay for loading Pillow's
    format plugins (about 0.1 s on a busy 2-core machine)."""
    for fmt in ("PNG", "JPEG"):
        buffer = io.BytesIO()
        Image.new("RGB", (2, 2)).save(buffer, format=fmt)
        decode_image(buffer.getvalue(), 4, "warm-up")


#: the image formats a request may send: those cameras, browsers and screenshots write, and no more of
#: Pillow's decoders (JPEG 2000 or float TIFF decode several times slower than PNG at the same size)
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
#: the most text a PNG's text chunks may decompress to (Pillow's default is 64 MiB, kept with the image)
PngImagePlugin.MAX_TEXT_MEMORY = 1 << 20


def decode_image(data: bytes, max_pixels: int, where: str, max_aspect: float = math.inf) -> Image.Image:
    """Decode to RGB, refusing an image whose header declares more than ``max_pixels``, or a longer
    side more than ``max_aspect`` times its shorter one, before any pixel is decoded: resizing a
    sliver of millions of pixels by two costs the model thread several times what a square image of
    as many pixels does."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
                width, height = img.size
                if width * height > max_pixels:
                    msg = (f"`{where}`: the image declares {width} x {height} = {width * height:,} pixels, more than "
                           f"the server's limit of {max_pixels:,} pixels")
                    _refuse(msg, where, "image_too_large")
                if max(width, height) > max_aspect * max(min(width, height), 1):
                    msg = (f"`{where}`: the image is {width} x {height} pixels, a side more than {max_aspect:g} times "
                           "the other (--max-image-aspect)")
                    _refuse(msg, where, "image_too_large")
                img.load()
                # an RGB image as decoded: convert() would copy it, and a burst holds one per request
                rgb = img if img.mode == "RGB" else img.convert("RGB")
                rgb.info.clear()  # metadata (text chunks, ICC profiles) would stay in memory with the pixels
                return rgb
    except RequestError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        _refuse(f"`{where}`: the image declares more pixels than the server's limit of {max_pixels:,} pixels "
                f"(the decoder refuses it: {exc})", where, "image_too_large")
    except UnidentifiedImageError:
        _refuse(f"`{where}`: not a decodable image (the formats accepted: {', '.join(IMAGE_FORMATS)})", where,
                "invalid_image")
    except (OSError, ValueError, SyntaxError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "MAX_TEXT_" in reason:  # Pillow's words for its limits: say which
            limit = PngImagePlugin.MAX_TEXT_MEMORY
            reason = f"its PNG text chunks hold more than the server's limit of {limit:,} bytes"
        _refuse(f"`{where}`: not a decodable image ({reason})", where, "invalid_image")
