"""Frame keys made where frames arrive: carried by the input, reused by the plan, never for other pixels."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from alpamayo_ros.core.frame_cache import frame_keys
from alpamayo_ros.core.frame_key import frame_key, is_frame_key, keyed_frame


def keyed(inputs):
    """inputs with the keys of its own frames."""
    return inputs.with_frame_keys(frame_keys(inputs))


def test_a_keyed_frame_is_read_only_and_keyed_by_its_pixels() -> None:
    image = np.random.default_rng(0).integers(0, 256, (12, 20, 3), dtype=np.uint8)
    frame = keyed_frame(1, 10, image)
    assert frame.key == frame_key(1, 10, image) and is_frame_key(frame.key, 1, 10, 12, 20)
    with pytest.raises(ValueError, match="read-only"):
        frame.image[0, 0, 0] = 7


def test_a_keyed_view_is_copied_so_its_base_cannot_change_the_pixels() -> None:
    base = np.zeros((2, 12, 20, 3), dtype=np.uint8)
    frame = keyed_frame(1, 10, base[1])
    base[1] = 255  # still writable: the frame holds its own copy
    assert frame.image.max() == 0 and frame.key == frame_key(1, 10, np.zeros((12, 20, 3), np.uint8))


def test_the_input_carries_its_keys_read_only_and_the_plan_takes_them(make_driving_input) -> None:
    inputs = make_driving_input(camera_indices=(0, 1), frames=2, height=24, width=40, seed=1)
    hashed = frame_keys(inputs)
    carried = keyed(inputs)
    assert list(carried.frame_keys) == hashed and inputs.frame_keys is None
    with pytest.raises(ValueError, match="read-only"):
        carried.images[0, 0, 0, 0, 0] ^= 1
    # the plan reads the carried keys instead of hashing: a well-formed stand-in comes back as given
    standin = [key[:-32] + f"{slot:032x}" for slot, key in enumerate(hashed)]
    assert frame_keys(inputs.with_frame_keys(standin)) == standin


def test_changed_images_never_carry_the_old_keys(make_driving_input) -> None:
    carried = keyed(make_driving_input(camera_indices=(0, 1), frames=2, height=24, width=40, seed=2))
    assert dataclasses.replace(carried, images=carried.images[:, :, ::2].copy()).frame_keys is None
    assert dataclasses.replace(carried, route_text="Turn left").frame_keys is None
    thawed = pickle.loads(pickle.dumps(carried))  # a writable copy: its keys are not trusted, they are hashed
    assert thawed.frame_keys == carried.frame_keys
    thawed.images[0, 0, 0, 0, 0] ^= 1
    assert frame_keys(thawed) == frame_keys(dataclasses.replace(thawed)) != list(carried.frame_keys)


def test_bad_keys_are_refused_by_name_and_the_input_is_untouched(make_driving_input) -> None:
    inputs = make_driving_input(camera_indices=(0, 1), frames=2, height=24, width=40, seed=3)
    keys = frame_keys(inputs)
    with pytest.raises(ValueError, match=r"frame_keys: 3 keys for 4 frames"):
        inputs.with_frame_keys(keys[:3])
    with pytest.raises(ValueError, match=r"frame_keys\[1\]: .* camera 0's frame at 10000000000 ns \(24x40\)"):
        inputs.with_frame_keys([keys[0], keys[2], keys[1], keys[3]])  # another slot's key
    with pytest.raises(ValueError, match=r"frame_keys\[3\]: None"):
        inputs.with_frame_keys([*keys[:3], None])
    with pytest.raises(ValueError, match=r"frame_keys\[0\]: .*32 hex digits"):
        inputs.with_frame_keys([keys[0][:-1], *keys[1:]])
    assert inputs.images.flags.writeable and inputs.frame_keys is None
    inputs.images[0, 0, 0, 0, 0] ^= 1  # still the caller's, writable


def test_a_view_carries_keys_only_with_its_base_frozen_too(make_driving_input) -> None:
    inputs = make_driving_input(camera_indices=(0, 1), frames=2, height=24, width=40, seed=4)
    flat = inputs.images.reshape(-1, 24, 40, 3).copy()  # a flat window, as alpamayo-serve builds one
    view = dataclasses.replace(inputs, images=flat.reshape(2, 2, 24, 40, 3))
    keyed = view.with_frame_keys(frame_keys(view))
    for array in (keyed.images, flat):  # neither the view nor the window under it can change the pixels
        with pytest.raises(ValueError, match="read-only"):
            array[0, 0, 0] ^= 1
    assert frame_keys(keyed) == list(keyed.frame_keys) == frame_keys(inputs)
