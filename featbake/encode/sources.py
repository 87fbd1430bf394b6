"""Data adapters: find inputs, and turn one file into the encoder's input tensor.

A source knows files and decoding, never models. Three ship today:

* :class:`AudioSource`: wav, flac, ogg (and mp3 where libsndfile has it), decoded with soundfile,
  mixed to mono, resampled with soxr, optionally cropped. Output: ``[T]`` float32 (``[C, T]`` when
  ``mono=False``).
* :class:`NpySource`: ``.npy`` arrays loaded as they are (float32), without pickles.
* :class:`featbake.encode.images.ImageSource`: JPEG, PNG, WebP, BMP, TIFF decoded with Pillow,
  then the recipe's image transform. Output: ``[C, H, W]`` float32.
* :class:`TextSource`: UTF-8 text (a ``.txt`` file, or a manifest's cell), tokenised with the
  recipe's tokenizer. Output: ``[N]`` int64 token ids.

Adding a source (video) means a new class with ``extensions`` and ``load``; the build
pipeline, keys and dataset do not change.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from decimal import ROUND_HALF_UP, Decimal
from enum import Enum
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple, Protocol, runtime_checkable

import numpy as np

from featbake.errors import ConfigError, SourceError, first_few, last_line
from featbake.process import ProcessLocal, ProcessLocalState
from featbake.recipe import Recipe, TextRecipe
from featbake.store.byteplace import bytes_at, not_an_input, printable
from featbake.store.hash_cache import FileStat

if TYPE_CHECKING:  # torch is loaded where a tensor is made: a process that only lists, scans or
    # hashes inputs (a Ray hashing task unpickling a container's reading) never imports it
    import torch


class Source(Protocol):
    """What the pipeline needs from a data adapter."""

    kind: str
    extensions: tuple[str, ...]

    def load(self, path: str | os.PathLike[str], data: BinaryIO | None = None) -> torch.Tensor:
        """Decode and preprocess one file into the encoder's input (no batch dimension).

        ``data``, when given, holds the input's bytes (an object read from a bucket, see
        :mod:`featbake.encode.inputs`); ``path`` then only names it in messages.
        """
        ...


@runtime_checkable
class CheckingSource(Protocol):
    """A source that tells by itself whether an input is still the one that was hashed."""

    def load_unchanged(self, path: str, stat: FileStat | None) -> torch.Tensor: ...


def load_unchanged(source: Source, path: str, stat: FileStat | None) -> torch.Tensor:
    """Decode ``path`` only if it is still the input whose digest was taken at ``stat``.

    The key was computed from the bytes hashed earlier; an input rewritten since would put its
    new features under the old bytes' key (served to every copy of the old input). A file is
    stat'ed again after decoding; an object is checked by the response that carried its bytes
    (:class:`CheckingSource`, see :mod:`featbake.encode.inputs`).

    Raises:
        SourceError: the input cannot be decoded, or changed since ``stat`` (None: never hashed).
    """
    if isinstance(source, CheckingSource):
        return source.load_unchanged(path, stat)
    x = source.load(path)
    if stat is None or file_stat_or_none(path) != stat:
        raise SourceError(f"{path}: changed while featbake was reading it; rerun the build")
    return x


def file_stat_or_none(path: str | os.PathLike[str]) -> FileStat | None:
    """The file's stat now, as the hash cache compares it, or None where it cannot be stat'ed
    (gone): what an input hashed earlier is checked against after it is decoded."""
    try:
        return FileStat.of(path)
    except OSError:
        return None


def _soundfile_extensions() -> tuple[str, ...]:
    import soundfile

    exts = [".wav", ".flac", ".ogg"]
    if "MP3" in soundfile.available_formats():
        exts.append(".mp3")
    return tuple(exts)


class SampleRule(Enum):
    """How a span's seconds become sample numbers: the rule of the tool that wrote the times,
    so what is decoded is what that tool's own loader decodes."""

    #: ``round(start * rate)`` and ``round(end * rate)``: featbake's manifests and Kaldi's
    #: segments (times that fall between two samples are rare there, and the keys stay put).
    NEAREST = "nearest"
    #: lhotse's ``compute_num_samples``: the start and the duration each rounded half up, at
    #: 8 decimals (``cut.load_audio()`` seeks and reads so; a 22.05 kHz cut at 1.25 s starts on
    #: sample 27,563, where Python's ``round`` gives 27,562).
    LHOTSE = "lhotse"
    #: NeMo's ``AudioSegment.from_file``: ``seek(int(offset * rate))`` then
    #: ``read(int(duration * rate))``, the offset and the duration each truncated (a row at
    #: offset 1.23456 s, 16 kHz, starts on sample 19,752, where ``round`` gives 19,753); a
    #: read past the file's end stops at it, as soundfile's does (a duration rounded up).
    NEMO = "nemo"


def lhotse_samples(seconds: float, rate: int) -> int:
    """Samples in ``seconds`` at ``rate`` as lhotse counts them (``lhotse.utils.
    compute_num_samples``): rounded to 8 decimals, then half up (not to even).

    Example:
        >>> lhotse_samples(1.25, 22050), round(1.25 * 22050)
        (27563, 27562)
        >>> lhotse_samples(0.1 + 0.2, 16000)
        4800
    """
    return int(Decimal(round(seconds * rate, 8)).quantize(0, rounding=ROUND_HALF_UP))


def nemo_bounds(offset: float, duration: float | None, rate: int) -> tuple[int, int | None]:
    """A NeMo manifest row's first and past-the-last sample at ``rate`` (None: to the
    recording's end), as NeMo's ``AudioSegment.from_file`` reads them: it seeks to
    ``int(offset * rate)`` and reads ``int(duration * rate)`` samples, each truncated on its
    own (so the end is not ``int((offset + duration) * rate)``).

    Example:
        >>> nemo_bounds(1.23456, 3.45678, 16000), round(1.23456 * 16000)
        ((19752, 75060), 19753)
        >>> nemo_bounds(2.5, None, 16000)
        (40000, None)
    """
    first = int(offset * rate)
    return first, None if duration is None else first + int(duration * rate)


def lhotse_bounds(start: float, duration: float | None, rate: int) -> tuple[int, int | None]:
    """A lhotse cut's first and past-the-last sample at ``rate`` (None: to the recording's
    end), as its ``load_audio`` reads them: the start and the duration as written, each
    counted by :func:`lhotse_samples` (never ``start + duration`` counted again: deep into a
    long recording the float sum loses the duration's last digits).

    Example:
        >>> lhotse_bounds(7200.0, 0.03, 22050), lhotse_bounds(1.25, None, 22050)
        ((158760000, 158760662), (27563, None))
    """
    first = lhotse_samples(start, rate)
    return first, None if duration is None else first + lhotse_samples(duration, rate)


class Span(NamedTuple):
    """``[start, end)`` seconds of a recording, and the one channel to take (None: all of them,
    mixed or kept as the recipe says): an item that is a segment of a file. ``end`` infinite
    runs to the recording's end (Kaldi's ``end = -1``, a row with a start and no end).
    ``rule``: how the seconds become samples (a lhotse cut's are lhotse's and a NeMo row's
    NeMo's, each counted from its ``duration`` as written where it has one)."""

    start: float
    end: float
    channel: int | None = None
    rule: SampleRule = SampleRule.NEAREST
    duration: float | None = None

    @property
    def to_end(self) -> bool:
        """Whether the span runs to the end of its recording (its end is known from the file)."""
        return self.end == float("inf")

    def frames(self, rate: int, total: int) -> tuple[int, int]:
        """The first and the past-the-last sample at ``rate``, by the span's :class:`SampleRule`,
        at the file's own rate; ``total`` (the recording's samples) for a span that runs to the
        end, and where a NeMo span's read stops (a ``duration`` past the end: NeMo reads to
        it; ``total`` negative, not known: its end as counted).

        Example:
            >>> Span(1.5, 2.0).frames(16000, 96000)
            (24000, 32000)
            >>> Span(1.5, float("inf")).frames(16000, 96000)
            (24000, 96000)
            >>> cut = Span(1.25, 1.6, None, SampleRule.LHOTSE)  # a 0.35 s lhotse cut
            >>> Span(1.25, 1.6).frames(22050, 96000), cut.frames(22050, 96000)
            ((27562, 35280), (27563, 35281))
            >>> Span(1.23456, 3.33456, None, SampleRule.NEMO, 2.1).frames(16000, 96000)
            (19752, 53352)
            >>> Span(0.0, 6.01, None, SampleRule.NEMO, 6.01).frames(16000, 96000)  # read to 6 s
            (0, 96000)
        """
        if self.rule is SampleRule.NEAREST:
            return round(self.start * rate), total if self.to_end else round(self.end * rate)
        length = None if self.to_end else self.duration or self.end - self.start
        counted = lhotse_bounds if self.rule is SampleRule.LHOTSE else nemo_bounds
        first, last = counted(self.start, length, rate)
        if last is None:
            return first, total
        return first, min(last, total) if self.rule is SampleRule.NEMO and total >= 0 else last


def span_problem(span: Span, frames: int, rate: int, channels: int) -> str | None:
    """Why ``span`` is not part of a recording of ``frames`` samples at ``rate`` with
    ``channels`` channels, or None when it is (checked from the file's header alone)."""
    first, last = span.frames(rate, frames)
    if first >= last and (span.to_end or first >= frames):  # a NeMo read stops at the end
        return (
            f"the segment starts at {span.start} s, at or past the end of its recording "
            f"({frames / rate:.3f} s); fix its start"
        )
    if first >= last:
        return f"the segment [{span.start}, {span.end}) holds no sample at {rate} Hz"
    if last > frames:
        return (
            f"the segment [{span.start}, {span.end}) ends past the end of its recording "
            f"({frames / rate:.3f} s); fix its end"
        )
    if span.channel is not None and not 0 <= span.channel < channels:
        return f"channel {span.channel} is not one of the recording's {channels} channels"
    return None


class AudioSource:
    """Audio files (or segments of them) -> mono float32 waveforms at the recipe's sample rate."""

    kind = "audio"

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.extensions = _soundfile_extensions()

    def load(self, path: str | os.PathLike[str], data: BinaryIO | None = None) -> torch.Tensor:
        """Decode, mix down, resample and crop one file (or ``data``, its bytes).

        Raises:
            SourceError: the file is missing, unreadable, empty or not audio.
        """
        return self.load_span(path, None, data)

    def load_span(
        self, path: str | os.PathLike[str], span: Span | None, data: BinaryIO | None = None
    ) -> torch.Tensor:
        """Decode ``span`` of a file (seeking to it, reading only its samples; None: the whole
        file), then mix, resample, crop and normalise it exactly as a whole file is.

        Raises:
            SourceError: the file is missing, unreadable or not audio, or the span is not in it.
        """
        rate, audio = self._read(path, span, data)
        if audio.shape[0] == 0:
            raise SourceError(f"{path}: the file holds no audio samples")
        low, high = float(audio.min()), float(audio.max())  # NaN and inf carry through
        if not (math.isfinite(low) and math.isfinite(high)):
            raise SourceError(f"{path}: the audio holds NaN or infinite samples")
        peak = max(high, -low)
        if peak > MAX_SAMPLE:
            raise overflowed(path, peak)
        if span is not None and span.channel is not None:
            audio = audio[:, span.channel : span.channel + 1]  # that channel, not the mix
        audio = audio.mean(axis=1, keepdims=True) if self.recipe.mono else audio
        if rate != self.recipe.sample_rate:
            audio = resampled(path, audio, rate, self.recipe.sample_rate)
        if self.recipe.max_seconds is not None:
            audio = audio[: round(self.recipe.max_seconds * self.recipe.sample_rate)]
        audio = np.ascontiguousarray(audio.T, dtype=np.float32)  # [C, T]
        if self.recipe.normalize:
            audio = zero_mean_unit_var(audio)
        if not np.isfinite(audio).all():  # decoded finite: overflowed in the steps above
            raise overflowed(path, peak)
        import torch

        return torch.from_numpy(audio[0] if self.recipe.mono else audio)

    def _read(
        self, path: str | os.PathLike[str], span: Span | None, data: BinaryIO | None
    ) -> tuple[int, np.ndarray]:
        """(the file's rate, ``[T, C]`` float32 samples of ``span`` or of the whole file)."""
        import soundfile

        try:
            # Opened once: rate, then samples.
            with soundfile.SoundFile(os.fspath(path) if data is None else data) as f:
                rate = f.samplerate
                first, last = span.frames(rate, f.frames) if span is not None else (0, -1)
                if span is not None and (why := span_problem(span, f.frames, rate, f.channels)):
                    raise SourceError(f"{path}: {why}")
                frames = last - first if span is not None else -1
                if self.recipe.max_seconds is not None:
                    # More than needed, so the resampler has its whole filter's context at the
                    # crop point: the crop equals resampling the whole file, then cropping (a
                    # margin of 64 samples left the last ones up to 2e-2 off at 44.1-96 kHz).
                    crop = int(np.ceil(self.recipe.max_seconds * rate)) + crop_margin(
                        rate, self.recipe.sample_rate
                    )
                    frames = crop if frames < 0 else min(frames, crop)
                if first:
                    f.seek(first)
                return rate, f.read(frames, dtype="float32", always_2d=True)
        except FileNotFoundError as e:
            raise SourceError(f"{path}: file not found") from e
        except (soundfile.LibsndfileError, RuntimeError, OSError, ValueError) as e:
            why = _unreadable(path) if data is None else None
            # Bytes in memory are named by libsndfile as <_io.BytesIO object at 0x...>: the path.
            reason = last_line(e).replace(repr(data), repr(os.fspath(path)))
            raise SourceError(f"{path}: {why or 'cannot decode audio'} ({reason})") from e


def crop_margin(rate: int, to: int) -> int:
    """Samples at ``rate`` read past a ``--max-seconds`` crop, so that soxr's HQ filter
    resampling to ``to`` Hz sees all it reads at the crop point: 4,096 a step of the rates'
    ratio (measured on noise from 8 to 192 kHz: past 1,024 the crop is within float32's
    rounding of resampling the whole file).

    Example:
        >>> crop_margin(16000, 16000), crop_margin(48000, 16000)
        (4096, 12288)
    """
    return 4096 * max(1, -(-rate // max(to, 1)))


def resampled(path: str | os.PathLike[str], audio: np.ndarray, rate: int, to: int) -> np.ndarray:
    """``[T, C]`` samples at ``rate`` resampled to ``to`` Hz, refused where nothing is left (a
    clip shorter than one sample at ``to``: an encoder failed on it, or stored empty features).

    Raises:
        SourceError: no sample is left.
    """
    out = soxr_resample(audio, rate, to)
    if out.shape[0] == 0:
        raise SourceError(
            f"{path}: {audio.shape[0]} sample(s) at {rate:,} Hz leave none resampled to {to:,} Hz"
        )
    return out


#: The largest decoded sample magnitude featbake's float32 steps take: past it a normalising
#: variance (a sum of squares: 1e24 a sample, 5.8e32 over 100 hours at 16 kHz) or a mix could
#: overflow float32 (3.4e38). Audio is [-1, 1]; a float file a few times past that is taken.
MAX_SAMPLE = 1e12


def overflowed(path: str | os.PathLike[str], peak: float) -> SourceError:
    """The error for finite samples (the largest of magnitude ``peak``) that featbake's steps
    (mixing the channels, resampling, normalising) would make NaN, infinite or all zero in
    float32: the encoder was blamed for the NaN features, and ``--allow-nonfinite``
    suggested; a variance overflowed to inf normalised every sample to 0, served silently."""
    return SourceError(
        f"{path}: its samples (the largest {peak:.3g}) overflow float32 when mixed, resampled "
        f"or normalised (featbake takes up to {MAX_SAMPLE:.0e}); scale the audio into [-1, 1]"
    )


def soxr_resample(audio: np.ndarray, rate: int, to: int) -> np.ndarray:
    """``[T, C]`` samples from ``rate`` to ``to`` Hz with soxr's HQ quality (featbake's one
    resampler: whole files and segments alike)."""
    import soxr

    return soxr.resample(audio, rate, to, quality="HQ")


def zero_mean_unit_var(audio: np.ndarray) -> np.ndarray:
    """Each channel to zero mean and unit variance, as Hugging Face's feature extractors do.

    Per clip and before any padding (``Wav2Vec2FeatureExtractor.zero_mean_unit_var_norm`` uses
    the unpadded length), so a clip's input never depends on what it is batched with.
    """
    mean = audio.mean(axis=-1, keepdims=True)
    var = audio.var(axis=-1, keepdims=True)
    return np.ascontiguousarray((audio - mean) / np.sqrt(var + 1e-7), dtype=np.float32)


def _unreadable(path: str | os.PathLike[str]) -> str | None:
    """Why the OS cannot open ``path`` (libsndfile only says "System error"), or None."""
    try:
        os.close(os.open(path, os.O_RDONLY))
    except FileNotFoundError:
        return "file not found"
    except OSError as e:
        return f"cannot read: {e.strerror}"
    return None


class NpySource:
    """``.npy`` arrays -> float32 tensors, loaded without pickles."""

    kind = "npy"
    extensions: tuple[str, ...] = (".npy",)

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe

    def load(self, path: str | os.PathLike[str], data: BinaryIO | None = None) -> torch.Tensor:
        """Load one array (from ``path``, or ``data``, its bytes) as float32.

        Raises:
            SourceError: missing, not a .npy, an object array, or empty.
        """
        try:
            arr = np.load(os.fspath(path) if data is None else data, allow_pickle=False)
        except FileNotFoundError as e:
            raise SourceError(f"{path}: file not found") from e
        except (ValueError, OSError, EOFError) as e:
            raise SourceError(f"{path}: not a readable .npy array ({last_line(e)})") from e
        if arr.size == 0:
            raise SourceError(f"{path}: the array is empty")
        if not np.issubdtype(arr.dtype, np.number):
            raise SourceError(f"{path}: arrays of dtype {arr.dtype} cannot be encoded")
        import torch

        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))


class TextSource(ProcessLocalState):
    """UTF-8 texts -> int64 token ids ``[N]``, by the recipe's tokenizer.

    The text is the file's (or cell's) bytes decoded as UTF-8, as they are: the key hashes those
    bytes, so what is tokenised is exactly what the key was made from. The tokenizer is loaded
    when the source is made (a missing or changed one is said once, not per text), again on
    first use in each worker (forked or pickled), and called under a lock: a Rust tokenizer's
    truncation settings are per call but shared state, and two threads setting them at once
    raise "Already borrowed". Both are per process: a worker forked while a thread of its
    parent tokenised would otherwise inherit the lock held, and hang on its first text.
    """

    kind = "text"
    extensions: tuple[str, ...] = (".txt",)

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.steps = text_steps(recipe)
        self._tokenizer = load_text_tokenizer(self.steps)

    _tokenizer: ProcessLocal[Any] = ProcessLocal(
        lambda self: load_text_tokenizer(self.steps), lock=True
    )
    _lock: ProcessLocal[threading.Lock] = ProcessLocal(lambda self: threading.Lock(), lock=True)

    def load(self, path: str | os.PathLike[str], data: BinaryIO | None = None) -> torch.Tensor:
        """Read one text (from ``path``, or ``data``, its bytes) and tokenise it.

        Raises:
            SourceError: missing, not UTF-8, empty, or (without truncation) too long.
        """
        try:
            if data is None:
                with open(path, "rb") as f:
                    raw = f.read()
            else:
                raw = data.read()
        except FileNotFoundError as e:
            raise SourceError(f"{path}: file not found") from e
        except OSError as e:
            raise SourceError(f"{path}: cannot read: {e.strerror or last_line(e)}") from e
        return self.token_ids(decoded_text(raw, path), path)

    def token_ids(self, text: str, name: str | os.PathLike[str]) -> torch.Tensor:
        """The token ids of ``text`` (``name`` only names it in messages).

        Raises:
            SourceError: the text gives no tokens, or more than ``max_length`` without truncation.
        """
        steps = self.steps
        if steps.lowercase:
            text = text.lower()
        cut = steps.max_length if steps.truncate else None
        tokenizer = self._tokenizer
        with self._lock:
            ids = tokenizer(
                text,
                add_special_tokens=steps.special_tokens,
                truncation=steps.truncate,
                max_length=cut,
                verbose=False,  # "longer than the maximum": featbake refuses it in its words
            )["input_ids"]
        if not ids:
            raise SourceError(f"{name}: the text gives no tokens; remove it from the data")
        if len(ids) > steps.max_length:
            raise SourceError(
                f"{name}: the text is {len(ids)} tokens, over max_length {steps.max_length}; "
                "shorten it, or let featbake cut it (drop --no-truncate)"
            )
        import torch

        return torch.tensor(ids, dtype=torch.int64)


def decoded_text(raw: bytes, name: str | os.PathLike[str]) -> str:
    r"""``raw`` as UTF-8 text, refused in one line when it is not UTF-8 or holds no text.

    Its newlines as they are, in a file, a tar member or a cell alike: a key names the bytes,
    whatever holds them, and a cell's or a tar member's loader keeps a ``\r`` (a ``.txt``
    read with ``open(path).read()`` gives ``\n`` for ``\r\n``: convert CRLF files, such as
    with ``dos2unix``, where a byte-level tokenizer would see the difference).

    Raises:
        SourceError: invalid UTF-8 (the offset named), or empty / only whitespace.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SourceError(
            f"{name}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
            "convert it to UTF-8 (e.g. iconv -t UTF-8)"
        ) from e
    if not text.strip():
        raise SourceError(f"{name}: the text is empty; remove it from the data")
    return text


def text_steps(recipe: Recipe) -> TextRecipe:
    """The recipe's tokenizer steps; a text recipe without them is refused in words.

    Raises:
        ConfigError: no tokenizer (the encoder is not a Hugging Face text folder).
    """
    if recipe.text is None:
        raise ConfigError(
            "--source text needs a tokenizer: give a Hugging Face text model folder as "
            "--encoder (its tokenizer is used), or Recipe(text=text_recipe_for_folder(folder))"
        )
    return recipe.text


def load_text_tokenizer(steps: TextRecipe) -> Any:
    """The tokenizer ``steps`` names, checked against its digest (files changed since the recipe
    was made, or a library it runs installed, removed or upgraded, would tokenise under the old
    key).

    Raises:
        ConfigError: the tokenizer's files or libraries changed since the recipe was made.
        EncoderLoadError: transformers cannot read the tokenizer.
    """
    from featbake.encode.hf_folders import load_tokenizer, tokenizer_digest

    tokenizer = load_tokenizer(steps.folder)
    if tokenizer_digest(steps.folder, tokenizer) != steps.tokenizer:
        raise ConfigError(
            f"the tokenizer in {steps.folder} (its files, or a library it runs) changed since "
            "this build's recipe was made; rerun the build"
        )
    return tokenizer


def source_extensions(kind: str) -> tuple[str, ...]:
    """The extensions a source kind reads: :func:`source_for`'s source's ``extensions``,
    without making one (no tokenizer loaded, no recipe needed).

    Example:
        >>> source_extensions("npy"), ".wav" in source_extensions("audio")
        (('.npy',), True)
    """
    if kind == "image":
        from featbake.encode.images import IMAGE_EXTENSIONS  # Pillow only for image builds

        return IMAGE_EXTENSIONS
    if kind == "text":
        return TextSource.extensions
    return NpySource.extensions if kind == "npy" else _soundfile_extensions()


def source_for(recipe: Recipe) -> Source:
    """The source adapter that the recipe names."""
    if recipe.source == "text":
        return TextSource(recipe)
    if recipe.source == "image":
        try:
            from featbake.encode.images import ImageSource  # Pillow only for image builds
        except ImportError as e:
            raise ConfigError(
                f"image inputs need Pillow ({e}); install it: pip install 'featbake[images]'"
            ) from e
        return ImageSource(recipe)
    return NpySource(recipe) if recipe.source == "npy" else AudioSource(recipe)


class SkippedInput(NamedTuple):
    """A file the scan found but will not hand to a decoder, and why."""

    path: str  # relative to the data folder, printable (undecodable bytes escaped)
    reason: str


class ScanResult(NamedTuple):
    """What :func:`scan_inputs` found: inputs (relative paths, sorted) and skipped files; and
    notes, one line each, on what the scan chose that is no failure (a webdataset sample's
    member left out beside the one encoded), which the build prints."""

    inputs: list[str]
    skipped: list[SkippedInput]
    notes: tuple[str, ...] = ()


def scan(data: str | os.PathLike[str], extensions: Sequence[str]) -> list[str]:
    """Relative paths of the input files under ``data`` (see :func:`scan_inputs`), sorted.

    Raises:
        SourceError: ``data`` is not a directory, or holds no matching file.
    """
    return scan_inputs(data, extensions).inputs


def scan_inputs(data: str | os.PathLike[str], extensions: Sequence[str]) -> ScanResult:
    """The inputs under ``data`` (a folder, or a bucket prefix) with one of ``extensions``, in
    a stable order, as its place lists them (:meth:`featbake.store.byteplace.BytePlace.inputs`).

    Hidden files and folders (a leading dot) are skipped; in a folder, symlinks are followed,
    each folder once (a link back up the tree, ``link -> .``, must not repeat its files), and
    only regular files are inputs: a FIFO would block the first ``open`` forever, and a socket
    or device is not data. Names that are not valid UTF-8 cannot be keyed in the catalog; they
    are skipped with a reason rather than stopping the build.

    Raises:
        SourceError: ``data`` is not a folder (prefix), or holds no matching file.
        StoreError: the bucket cannot be listed.
    """
    where = os.fspath(data)
    found = bytes_at(where).inputs(where, extensions)
    return ScanResult(found.inputs, [SkippedInput(*s) for s in found.skipped], found.notes)


def check_input_files(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    """The paths of a list of inputs, expanded (``~``), after :func:`not_an_input` on each.

    Raises:
        SourceError: the list is empty, or some paths are not inputs (up to five named, each
            with its reason, in one message).
    """
    expanded = [os.path.expanduser(os.fspath(p)) for p in paths]
    if not expanded:
        raise SourceError("the list of input files is empty")
    bad = [(p, why) for p in expanded if (why := not_an_input(p, p)) is not None]
    if bad:
        shown = first_few((f"{printable(p)}: {why}" for p, why in bad[:5]), len(bad))
        raise SourceError(
            f"{len(bad)} of the {len(expanded)} input files cannot be inputs: {shown}; "
            "remove them from the list (only regular files are read)"
        )
    return expanded
