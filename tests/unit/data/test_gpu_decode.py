"""``data.decode=gpu``'s steps run on the CPU: workers read bytes and draw the crops, the
device-side decoder (here libjpeg-turbo through the same ``decode_jpeg`` list call) orients,
crops, resizes and flips. The same seed gives the CPU path's pixels exactly: the same decoder,
the same resize function on the same device; only nvJPEG on CUDA differs (a grey level or two:
its IDCT and chroma upsampling, and the resize computed in float)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.image_files import picture, truncate
from trainkit.core.errors import TrainkitError
from trainkit.data import DevicePrefetcher
from trainkit.data.batches import Encoded
from trainkit.data.device.gpu_decode import JpegDecoder
from trainkit.data.loader.resumable import make_loader
from trainkit.data.sources.image_folder import ImageFiles, collate_images
from trainkit.data.sources.jpeg_files import JpegFiles, collate_encoded, jpeg_plan
from trainkit.data.transforms import eval_transform, train_transform

SIZES = [(48, 64), (71, 53), (40, 40), (90, 33)]


def _jpeg(path: Path, array: np.ndarray, *, orientation: int = 1, mode: str = "RGB",
          **options: object) -> Path:
    image = Image.fromarray(array).convert(mode)
    exif = image.getexif()
    if orientation != 1:
        exif[0x0112] = orientation
    image.save(path, exif=exif, quality=90, **options)
    return path


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """JPEGs of several sizes in every EXIF orientation, RGB and grayscale."""
    root, rng = tmp_path_factory.mktemp("jpegs"), np.random.default_rng(0)
    files = []
    for orientation in range(1, 9):
        h, w = SIZES[orientation % len(SIZES)]
        mode = "L" if orientation == 3 else "RGB"
        files.append(_jpeg(root / f"o{orientation}.jpg", picture(rng, orientation, h, w),
                           orientation=orientation, mode=mode))
    return [str(f) for f in files]


def _cpu_path(files: list[str], transform: object, channels: int = 3) -> torch.Tensor:
    random.seed(5)
    data = ImageFiles(files, [0] * len(files), transform, channels=channels)
    return collate_images([data[i] for i in range(len(files))]).images


def _gpu_path(files: list[str], transform: object, channels: int = 3, *,
              skip: bool = False) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    random.seed(5)
    data = JpegFiles(files, list(range(len(files))), transform, channels=channels,
                     skip_corrupt=skip)
    batch = collate_encoded([data[i] for i in range(len(files))])
    skipped: list[str] = []
    decoder = JpegDecoder("cpu", channels=channels, transform=transform, skip_corrupt=skip)
    images, labels = decoder(batch.images, batch.labels, skipped.extend)
    return images, labels, skipped


@pytest.mark.parametrize("channels", [3, 1])
def test_training_crops_are_the_cpu_paths_pixels_for_the_same_seed(jpegs: list[str],
                                                                   channels: int) -> None:
    transform = train_transform(24, scale=(0.2, 1.0))
    images, _, _ = _gpu_path(jpegs, transform, channels)
    assert images.shape == (len(jpegs), channels, 24, 24) and images.dtype == torch.uint8
    assert torch.equal(images, _cpu_path(jpegs, transform, channels))


def test_evaluation_is_the_cpu_paths_resize_and_centre_crop(jpegs: list[str]) -> None:
    transform = eval_transform(28, crop_pct=0.875)
    assert torch.equal(_gpu_path(jpegs, transform)[0], _cpu_path(jpegs, transform))


def test_the_worker_sends_bytes_and_a_crop_drawn_in_oriented_coordinates(
        jpegs: list[str]) -> None:
    random.seed(1)
    sample = JpegFiles(jpegs, [0] * len(jpegs), train_transform(24))[5]  # orientation 6
    assert isinstance(sample[0], Encoded)
    plan = sample[0].plan
    h, w = SIZES[6 % len(SIZES)]
    assert (plan.height, plan.width, plan.orientation) == (w, h, 6)  # turned: sides swapped
    top, left, ch, cw = plan.box
    assert top + ch <= plan.height and left + cw <= plan.width and min(top, left) >= 0
    assert Path(jpegs[5]).read_bytes() == sample[0].data.numpy().tobytes()


def test_other_files_are_finished_in_the_worker_as_on_the_cpu_path(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    png = tmp_path / "a.png"
    Image.fromarray(picture(rng, 1, 50, 60)).save(png)
    cmyk = _jpeg(tmp_path / "cmyk.jpg", picture(rng, 2, 44, 52), mode="CMYK")
    progressive = _jpeg(tmp_path / "p.jpg", picture(rng, 3, 64, 48), progressive=True)
    plain = _jpeg(tmp_path / "b.jpg", picture(rng, 4, 52, 66))
    files = [str(png), str(cmyk), str(progressive), str(plain)]
    for path in files[:3]:
        assert jpeg_plan(Path(path).read_bytes(), train_transform(24)) is None, path
    transform = train_transform(24)
    images, _, _ = _gpu_path(files, transform)
    assert torch.equal(images, _cpu_path(files, transform))
    only_others = files[:3]  # a batch without a JPEG for the device
    assert torch.equal(_gpu_path(only_others, transform)[0], _cpu_path(only_others, transform))


def test_a_jpeg_the_decoder_rejects_is_named_or_skipped(jpegs: list[str],
                                                        tmp_path: Path) -> None:
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(Path(jpegs[0]).read_bytes())
    truncate(cut, 0.6)  # the header reads; the decoder refuses the rest
    files = [jpegs[1], str(cut), jpegs[2]]
    with pytest.raises(TrainkitError) as caught:
        _gpu_path(files, train_transform(24))
    message = str(caught.value)
    assert message.endswith(str(cut)) and "data.skip_corrupt=true" in message
    assert "\n" not in message and "decode_jpeg.cpp" not in message, message

    images, labels, skipped = _gpu_path(files, train_transform(24), skip=True)
    assert skipped == [str(cut)] and images.shape[0] == 3  # the batch keeps its size
    assert torch.equal(images[1], images[0]) and labels.tolist() == [0, 0, 2]


def test_an_unreadable_file_in_the_worker_is_a_bad_sample(tmp_path: Path) -> None:
    broken = tmp_path / "x.jpg"
    broken.write_bytes(b"not a jpeg")
    batch = collate_encoded([JpegFiles([str(broken)], [0], train_transform(24))[0]])
    assert batch.bad and batch.bad[0].path == str(broken)


def test_the_image_loader_serves_the_cpu_paths_batches_through_a_worker(
        jpegs: list[str], tmp_path: Path) -> None:
    """The whole path: a worker process, the per-batch seeds, the prefetcher's finish hook
    before normalisation, a PNG among the JPEGs."""
    png = tmp_path / "a.png"
    Image.fromarray(picture(np.random.default_rng(2), 1, 50, 60)).save(png)
    files, transform = [*jpegs, str(png)], train_transform(24)
    labels = [i % 3 for i in range(len(files))]
    stats = ((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))

    def batches(gpu: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        kind, collate = (JpegFiles, collate_encoded) if gpu else (ImageFiles, collate_images)
        loader = make_loader(kind(files, labels, transform), 4, shuffle=True, seed=3,
                             num_workers=1, collate_fn=collate)
        decoder = JpegDecoder("cpu", channels=3, transform=transform) if gpu else None
        images = DevicePrefetcher(loader, "cpu", mean=stats[0], std=stats[1], decoder=decoder,
                                  normalize_float=False)
        images.set_epoch(1)
        return list(images)

    gpu, cpu = batches(True), batches(False)
    assert len(gpu) == len(cpu) == 3
    for (x, y), (x_cpu, y_cpu) in zip(gpu, cpu):
        assert x.dtype == torch.float32 and torch.equal(x, x_cpu) and torch.equal(y, y_cpu)


def test_the_gpu_check_lists_the_decode_case_for_cuda_only() -> None:
    from benchmarks.gpu_check import ALONE, CASES

    assert CASES["gpu_decode"][1] is False and "gpu_decode" in ALONE  # a timing: run alone


# -- what the per-image fallback must not hide (defect 5) and the stream order (defect 6) --------

_ACCELERATOR_ERROR = getattr(torch, "AcceleratorError", RuntimeError)  # torch 2.11 may lack it


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    _ACCELERATOR_ERROR("CUDA error: an illegal memory access was encountered"),
    RuntimeError("decode_jpegs_cuda: torchvision not compiled with nvJPEG support"),
    RuntimeError("Error while decoding JPEG images: CUDA out of memory. Tried to allocate 8 MiB"),
], ids=["oom", "accelerator", "no-nvjpeg", "oom-wrapped-by-torchvision"])
def test_device_errors_are_raised_not_decoded_one_by_one_on_the_cpu(
        jpegs: list[str], monkeypatch: pytest.MonkeyPatch, error: RuntimeError) -> None:
    calls = []

    def failing(*args: object, **kwargs: object) -> None:
        calls.append(args)
        raise error

    monkeypatch.setattr("torchvision.io.decode_jpeg", failing)
    with pytest.raises(type(error), match=str(error)[:20]):
        _gpu_path(jpegs[:3], train_transform(24))
    assert len(calls) == 1  # the batch call only: no image tried alone, none on the CPU


def test_a_file_the_device_refuses_still_decodes_on_the_cpu(jpegs: list[str]) -> None:
    """The seam: an injected decode function that refuses the batch as nvJPEG refuses a
    variant it lacks; each image goes through it alone, then the CPU path's decoder."""
    from torchvision.io import decode_jpeg

    calls = []

    def refusing(data: list[torch.Tensor], **kwargs: object) -> list[torch.Tensor]:
        calls.append(len(data))
        if len(data) > 1 or len(calls) == 2:  # the batch, and the first image alone
            raise RuntimeError("Error while decoding JPEG images: Failed to decode batch: 6")
        return decode_jpeg(data, **kwargs)

    transform = eval_transform(28)
    random.seed(5)
    data = JpegFiles(jpegs[:3], [0, 1, 2], transform)
    batch = collate_encoded([data[i] for i in range(3)])
    decoder = JpegDecoder("cpu", channels=3, transform=transform, decode=refusing)
    images, _ = decoder(batch.images, batch.labels)
    assert calls == [3, 1, 1, 1] and torch.equal(images, _cpu_path(jpegs[:3], transform))


def test_nvjpeg_is_probed_once_in_one_line() -> None:
    from trainkit.core.errors import ConfigError
    from trainkit.data.device.gpu_decode import probe_nvjpeg

    assert probe_nvjpeg("cpu").startswith("data.decode=gpu: torchvision ")

    def missing(*args: object, **kwargs: object) -> None:
        raise RuntimeError("decode_jpegs_cuda: torchvision not compiled with nvJPEG support\n"
                           "Exception raised from decode_jpegs_cuda at decode_jpegs_cuda.cpp:12")

    with pytest.raises(ConfigError) as caught:
        probe_nvjpeg("cpu", decode=missing)
    message = str(caught.value)
    assert "not compiled with nvJPEG support" in message and "\n" not in message
    assert message.endswith("use data.decode=cpu")


class _Stream:
    def __init__(self, name: str, events: list[str]) -> None:
        self.name, self.events = name, events

    def wait_stream(self, other: _Stream) -> None:
        self.events.append(f"{self.name} waits for {other.name}")


class _Image:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def record_stream(self, stream: _Stream) -> None:
        self.events.append(f"image used on {stream.name}")


def test_decoded_images_are_allocated_on_a_stream_of_their_own_and_ordered_before_use() -> None:
    """torchvision allocates on the current stream and writes on its own without waiting for
    it: the images must come from a stream that runs nothing else, the user's stream must wait
    for it, and each image must record its use there (else a block freed by the last batch, its
    resize still queued, is written over)."""
    from trainkit.data.device.gpu_decode import StreamOrder

    events: list[str] = []
    ours, user = _Stream("ours", events), _Stream("user", events)
    current = [user]

    class Context:
        def __init__(self, stream: _Stream) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            current.append(self.stream)

        def __exit__(self, *exc: object) -> None:
            current.pop()

    def decode(data: list[int], **kwargs: object) -> list[_Image]:
        events.append(f"decoded {len(data)} with {current[-1].name} current")
        return [_Image(events) for _ in data]

    order = StreamOrder(torch.device("cpu"), stream=ours, current=lambda: current[-1],
                        context=Context)
    order.decode(decode, [1, 2], mode=None)
    assert events == ["decoded 2 with ours current", "user waits for ours",
                      "image used on user", "image used on user"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_decoded_images_are_not_written_over_while_a_lagging_stream_reads_them(
        jpegs: list[str]) -> None:
    """On the prefetcher's side stream, slowed before each batch: two batches alternate, each
    decoded while the last one's resize still waits; each must equal its own decode alone."""
    transform = eval_transform(28)
    random.seed(5)
    data = JpegFiles(jpegs, list(range(len(jpegs))), transform)
    halves = [collate_encoded([data[i] for i in part]).images for part in ((0, 1, 2, 3),
                                                                            (4, 5, 6, 7))]
    decoder = JpegDecoder("cuda", channels=3, transform=transform)
    alone = [decoder(h, torch.zeros(4, dtype=torch.int64))[0].cpu() for h in halves]
    side, got = torch.cuda.Stream(), []
    with torch.cuda.stream(side):
        for i in range(8):
            torch.cuda._sleep(20_000_000)  # the side stream lags: the next decode runs meanwhile
            got.append(decoder(halves[i % 2], torch.zeros(4, dtype=torch.int64))[0])
    torch.cuda.synchronize()
    for i, images in enumerate(got):
        assert torch.equal(images.cpu(), alone[i % 2]), f"batch {i} was written over"


def test_decode_gpu_pins_the_images_finished_in_the_worker(tmp_path: Path) -> None:
    """Pinned, their copy to the device does not block the host (the DataLoader calls
    pin_memory on a batch's objects that have it)."""
    png = tmp_path / "a.png"
    Image.fromarray(picture(np.random.default_rng(3), 1, 40, 50)).save(png)
    batch = collate_encoded([JpegFiles([str(png)], [0], train_transform(24))[0]]).images
    assert batch.items[0] is not None and hasattr(batch, "pin_memory")
    if torch.cuda.is_available():
        assert batch.pin_memory().items[0].is_pinned()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("training", [True, False])
def test_cuda_decodes_exif_oriented_jpegs_as_the_cpu_path(jpegs: list[str],
                                                          training: bool) -> None:
    """nvJPEG ignores EXIF: every orientation (1-8, one grayscale) turned on the device as the
    CPU path turns it; nvJPEG's IDCT and the float resize differ by a few grey levels only,
    a wrong turn by far more (the pictures are ramps)."""
    transform = train_transform(24, scale=(0.5, 1.0)) if training else eval_transform(28)
    random.seed(5)
    data = JpegFiles(jpegs, list(range(len(jpegs))), transform)
    batch = collate_encoded([data[i] for i in range(len(jpegs))])
    decoder = JpegDecoder("cuda", channels=3, transform=transform)
    images = decoder(batch.images, batch.labels)[0].cpu()
    expected = _cpu_path(jpegs, transform)
    assert images.shape == expected.shape
    for i, (got, want) in enumerate(zip(images.float(), expected.float())):
        assert (got - want).abs().mean() < 4, f"orientation {i + 1}"
