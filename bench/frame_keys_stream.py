"""Pipeline.preprocess's cost on a streaming W16 window (4 cameras x 4 full-HD frames, one new frame
per camera per plan): frames hashed by every plan vs keys made once where each frame arrives
(keyed_frame, as the drive loop does) and carried by the DrivingInput. CPU only, no model.

    PYTHONPATH=$PWD .venv/bin/python bench/frame_keys_stream.py
"""

import statistics, time
import numpy as np, torch
from alpamayo_ros.core.frame_cache import FrameCache, frame_keys
from alpamayo_ros.core.frame_key import keyed_frame
from alpamayo_ros.core.preprocess import VisionGeometry
from alpamayo_ros.core.types import DrivingInput
rng, cams, step = np.random.default_rng(0), (0, 1, 2, 6), 100_000_000
hist = dict(ego_history_xyz=np.zeros((16, 3), np.float32), ego_history_rot=np.tile(np.eye(3, dtype=np.float32), (16, 1, 1)))
def run(carried: bool, plans: int = 14) -> tuple[float, float]:
    cache = FrameCache(VisionGeometry(), compute_device=torch.device("cpu"), store_device=torch.device("cpu"), capacity=32)
    window, arrive, pre = {c: [] for c in cams}, [], []
    for k in range(plans + 3):
        for c in cams:  # one new frame per camera per plan (10 Hz), keyed where it arrives
            rendered = rng.integers(0, 256, (1080, 1920, 3), dtype=np.uint8)
            t = time.perf_counter()
            frame = keyed_frame(c, k * step, rendered)
            arrive.append((time.perf_counter() - t) * 1e3)
            window[c] = (window[c] + [frame])[-4:]
        if k < 3:
            continue
        images = np.empty((4, 4, 1080, 1920, 3), np.uint8)
        for row, c in enumerate(cams):
            for col, f in enumerate(window[c]):
                images[row, col] = f.image
        stamps = np.array([[(k - 3 + j) * step for j in range(4)]] * 4, np.int64)
        inputs = DrivingInput(images=images, camera_indices=cams, frame_stamps_ns=stamps, t0_ns=int(stamps[0, -1]), **hist)
        if carried:
            inputs = inputs.with_frame_keys([f.key for c in cams for f in window[c]])
        t = time.perf_counter()  # Pipeline.preprocess: keys, then the cache resizes what is new
        keys = frame_keys(inputs)
        t_keys = time.perf_counter()
        cache.preprocess(inputs.images.reshape(16, 1080, 1920, 3), keys)
        pre.append(((time.perf_counter() - t) * 1e3, (t_keys - t) * 1e3))
    return [statistics.median(p[i] for p in pre[2:]) for i in (0, 1)], statistics.median(arrive[4:])
torch.set_num_threads(2)
for carried in (False, True, False, True):
    (p, keys), a = run(carried)
    print(f"{'carried keys   ' if carried else 'hashed per plan'}: preprocess {p:6.1f} ms/plan, of it frame_keys "
          f"{keys:6.2f} ms (medians; 12 hits + 4 new frames); keyed_frame at arrival {a:.2f} ms/frame")
