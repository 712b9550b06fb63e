"""Procedurally generated images with captions: vision data that needs no download.

A scene is a dark, slightly noisy square image holding one or more coloured shapes (`SHAPES` in
`COLORS`), each in its own cell of a 2x2 grid (`CELLS`), at a random place and size inside it. Its
caption names every object's colour, shape and cell, in cell order (``"red circle top left, blue
square bottom right"``); a single-object scene also has a class, its shape and cell (`CLASSES`:
``"circle top left"`` is class 0). Scene ``i`` of a split is a pure function of ``(seed, split, i)``,
so the held-out split is a different stream of scenes and any batch can be rebuilt from its index.

Images are float32 ``[size, size, 3]`` in ``[-1, 1]``; everything here is numpy.
"""

from __future__ import annotations

import dataclasses
import functools

import grain
import numpy as np

from mtjax.train.data import batch_indices, batches_by_index, check_rows, decoder_rows
from mtjax.train.tokenizer import Tokenizer

SHAPES = ("circle", "square", "triangle", "cross")
COLORS = {"red": (0.9, 0.15, 0.15), "green": (0.15, 0.8, 0.2), "blue": (0.2, 0.35, 0.95),
          "yellow": (0.95, 0.85, 0.15), "magenta": (0.85, 0.2, 0.85), "cyan": (0.15, 0.85, 0.85)}
CELLS = ("top left", "top right", "bottom left", "bottom right")
CLASSES = tuple(f"{shape} {cell}" for shape in SHAPES for cell in CELLS)
SPLITS = ("train", "eval")
SCENE_TASKS = ("classification", "captioning")


@dataclasses.dataclass(frozen=True)
class Scene:
    """One rendered scene.

    Attributes:
      image: float32 ``[size, size, 3]`` in ``[-1, 1]``.
      objects: ``(color, shape, cell)`` name triples, in cell order.
    """

    image: np.ndarray
    objects: tuple[tuple[str, str, str], ...]

    @property
    def caption(self) -> str:
        return ", ".join(f"{color} {shape} {cell}" for color, shape, cell in self.objects)

    @property
    def label(self) -> int:
        """The `CLASSES` index of a single-object scene's shape and cell."""
        if len(self.objects) != 1:
            raise ValueError(f"Scene.label: a scene of {len(self.objects)} objects has no class (only one-object "
                             "scenes do)")
        _, shape, cell = self.objects[0]
        return SHAPES.index(shape) * len(CELLS) + CELLS.index(cell)


def _shape_mask(shape: str, dy: np.ndarray, dx: np.ndarray, radius: float) -> np.ndarray:
    """Pixels (offsets ``dy``, ``dx`` from the centre) inside ``shape`` of half-size ``radius``."""
    if shape == "circle":
        return dy ** 2 + dx ** 2 <= radius ** 2
    if shape == "square":
        return np.maximum(np.abs(dy), np.abs(dx)) <= 0.9 * radius
    if shape == "triangle":  # apex up, base at the bottom as wide as the shape is tall
        return (np.abs(dy) <= radius) & (np.abs(dx) <= 0.5 * (dy + radius))
    bar = radius / 3
    return ((np.abs(dx) <= bar) & (np.abs(dy) <= radius)) | ((np.abs(dy) <= bar) & (np.abs(dx) <= radius))


def render_scene(rng: np.random.Generator, *, image_size: int = 32, num_objects: int = 1) -> Scene:
    """A scene of ``num_objects`` (1 to 4) objects in distinct cells, drawn with ``rng``."""
    if not 1 <= num_objects <= len(CELLS):
        raise ValueError(f"render_scene: num_objects={num_objects}; expected 1..{len(CELLS)}")
    if image_size < 16 or image_size % 2:
        raise ValueError(f"render_scene: image_size={image_size}; expected an even size >= 16")
    cell_size = image_size / 2
    ys, xs = np.mgrid[0:image_size, 0:image_size] + 0.5
    objects, masks = [], []
    for cell in sorted(rng.choice(len(CELLS), size=num_objects, replace=False)):
        color = list(COLORS)[rng.integers(len(COLORS))]
        shape = SHAPES[rng.integers(len(SHAPES))]
        # Place and size as fractions of the cell, so a scene's content does not depend on image_size.
        fraction = rng.uniform(0.28, 0.42)
        offset_y, offset_x = rng.uniform(0.0, 1.0, 2)
        radius = cell_size * fraction
        top, left = (cell // 2) * cell_size, (cell % 2) * cell_size
        cy = top + radius + 0.5 + offset_y * (cell_size - 2 * radius - 1)
        cx = left + radius + 0.5 + offset_x * (cell_size - 2 * radius - 1)
        rgb = np.clip(np.asarray(COLORS[color]) + rng.uniform(-0.08, 0.08, 3), 0.0, 1.0)
        masks.append((_shape_mask(shape, ys - cy, xs - cx, radius), rgb))
        objects.append((color, shape, CELLS[cell]))
    image = 0.08 + 0.03 * rng.standard_normal((image_size, image_size, 3))
    for mask, rgb in masks:
        image[mask] = rgb
    image = np.clip(image, 0.0, 1.0) * 2.0 - 1.0
    return Scene(image.astype(np.float32), tuple(objects))


class SceneDataset:
    """An endless stream of scenes (one split), served as batches.

    ``task="classification"``: one-object scenes, ``{"images" [b, size, size, 3] float32, "labels" [b]
    int32}`` (`CLASSES`). ``task="captioning"``: scenes of 1 to ``max_objects`` objects, ``{"images",
    "inputs", "targets", "weights"}``: ``inputs [b, seq_len]`` is ``tokenizer.eos_id`` (the start
    token) then the caption's tokens, ``targets`` the caption's tokens then ``eos_id``, ``weights``
    1.0 on the caption and its end, 0.0 on the padding (token 0) after it.

    Attributes:
      task: ``"classification"`` or ``"captioning"``.
      split: ``"train"`` or ``"eval"``.
      image_size: image side in pixels.
      seed: with the split and the scene's index, seeds each scene.
      max_objects: most objects in a caption scene.
      tokenizer: encodes captions (captioning).
      seq_len: caption tokens per row, the start/end token included (captioning).
    """

    def __init__(self, task: str, split: str, *, image_size: int = 32, seed: int = 0, max_objects: int = 2,
                 tokenizer: Tokenizer | None = None, seq_len: int = 64):
        if task not in SCENE_TASKS:
            raise ValueError(f"SceneDataset: task={task!r}; accepted: {', '.join(SCENE_TASKS)}")
        if split not in SPLITS:
            raise ValueError(f"SceneDataset: split={split!r}; accepted: {', '.join(SPLITS)}")
        if not 1 <= max_objects <= len(CELLS):
            raise ValueError(f"SceneDataset: max_objects={max_objects}; expected 1..{len(CELLS)}")
        if task == "captioning":
            if tokenizer is None:
                raise ValueError("SceneDataset: task='captioning' needs a tokenizer")
            # The longest names: magenta, triangle and the last cells (CELLS grow longer).
            longest = len(tokenizer.encode(", ".join(f"magenta triangle {cell}" for cell in CELLS[-max_objects:])))
            if seq_len < longest + 1:
                raise ValueError(f"SceneDataset: seq_len={seq_len} cannot hold the longest caption of "
                                 f"{max_objects} objects ({longest} tokens + 1); use at least {longest + 1}")
        self.task, self.split, self.image_size, self.seed = task, split, image_size, seed
        self.max_objects, self.tokenizer, self.seq_len = max_objects, tokenizer, seq_len

    def scene(self, index: int) -> Scene:
        """Scene ``index`` of this split."""
        rng = np.random.default_rng([self.seed, SPLITS.index(self.split), index])
        count = 1 if self.task == "classification" else int(rng.integers(1, self.max_objects + 1))
        return render_scene(rng, image_size=self.image_size, num_objects=count)

    def caption_tokens(self, caption: str) -> dict[str, np.ndarray]:
        """``inputs``, ``targets`` and ``weights`` ``[seq_len]`` of one caption (see the class docstring)."""
        return decoder_rows(self.tokenizer.encode(caption), self.tokenizer.eos_id, self.seq_len)

    def batches(self, batch_size: int, rows: slice | None = None) -> grain.MapDataset:
        """The endless global batches as a grain ``MapDataset`` (``batches(n)[i]`` is batch ``i``),
        ``rows`` of each (default all): `mtjax.train.data.BatchSource`."""
        check_rows(rows, batch_size)
        return batches_by_index(functools.partial(self._batch, batch_size=batch_size, rows=rows))

    def _batch(self, index: int, batch_size: int, rows: slice | None = None) -> dict[str, np.ndarray]:
        """Rows ``rows`` (default all) of batch ``index``: scenes ``index * batch_size + row``."""
        scenes = [self.scene(int(i)) for i in batch_indices(index, batch_size, rows)]
        batch = {"images": np.stack([s.image for s in scenes])}
        if self.task == "classification":
            batch["labels"] = np.asarray([s.label for s in scenes], np.int32)
        else:
            captions = [self.caption_tokens(s.caption) for s in scenes]
            batch.update({name: np.stack([c[name] for c in captions]) for name in captions[0]})
        return batch

