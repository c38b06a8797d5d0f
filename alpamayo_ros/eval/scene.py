"""A synthetic road world for the closed-loop demo: geometry, pinhole cameras and a clamped vehicle.

Everything is drawn with cv2 polygons on a flat ground plane (road, lane markings, roadside
poles), so a handful of small camera images render in milliseconds on a CPU. The vehicle
follows whatever path it is given, but is clamped to stay on the road at a plausible speed,
because a tiny random model plans nonsense and the demo must keep running.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import cv2
import numpy as np

from alpamayo_ros.core.types import CAMERAS

NEAR_M = 0.5  # camera near plane
FAR_M = 90.0  # nothing is drawn further away

SKY = (150, 190, 235)
GRASS = (70, 120, 60)
ASPHALT = (85, 85, 90)
PAINT = (235, 235, 225)
POLE = (200, 80, 40)


@dataclass(frozen=True)
class PinholeCamera:
    """A level pinhole camera on the ego vehicle.

    x_m, y_m, z_m: mount position in the ego frame (x forward, y left, z up).
    yaw: rotation about z of the optical axis from the ego x axis (left positive).
    """

    index: int
    width: int
    height: int
    fov_deg: float
    x_m: float = 1.5
    y_m: float = 0.0
    z_m: float = 1.5
    yaw: float = 0.0

    @property
    def fx(self) -> float:
        return (self.width / 2) / math.tan(math.radians(self.fov_deg) / 2)

    @property
    def intrinsics(self) -> tuple[float, float, float, float]:
        """(fx, fy, cx, cy) in pixels; square pixels."""
        return self.fx, self.fx, self.width / 2, self.height / 2

    @property
    def name(self) -> str:
        return CAMERAS[self.index][0]


def default_rig(width: int = 256, height: int = 144) -> tuple[PinholeCamera, ...]:
    """Front, front-left and front-right cameras (upstream indices 1, 0, 2), 120 degree FOV.

    The front camera comes first so a shortened rig keeps it.
    """
    return (
        PinholeCamera(1, width, height, 120.0, x_m=1.8),
        PinholeCamera(0, width, height, 120.0, x_m=1.8, y_m=0.6, yaw=math.radians(60)),
        PinholeCamera(2, width, height, 120.0, x_m=1.8, y_m=-0.6, yaw=math.radians(-60)),
    )


def _yaw_rotate(xy: np.ndarray, yaw: float) -> np.ndarray:
    c, s = math.cos(yaw), math.sin(yaw)
    return xy @ np.array([[c, s], [-s, c]])


@dataclass
class Road:
    """A two-lane road: centerline sampled every step_m, lanes lane_width_m wide each side."""

    centerline: np.ndarray  # (N, 2) world xy
    heading: np.ndarray  # (N,) world yaw of the centerline
    step_m: float
    lane_width_m: float = 3.5

    @classmethod
    def winding(cls, length_m: float = 1200.0, step_m: float = 1.0, seed: int = 7) -> Road:
        """Straights and gentle curves (radius >= 60 m), reproducible from seed."""
        rng = np.random.default_rng(seed)
        n = int(length_m / step_m)
        curvature = np.zeros(n)
        s = 60  # start with a straight so the first plans see a simple road
        while s < n:
            run = int(rng.uniform(40, 120) / step_m)
            curvature[s:s + run] = rng.choice([0.0, 1.0, -1.0]) * rng.uniform(1 / 250, 1 / 60)
            s += run
        heading = np.concatenate([[0.0], np.cumsum(curvature[:-1] * step_m)])
        xy = np.concatenate([[[0.0, 0.0]], np.cumsum(step_m * np.stack([np.cos(heading[:-1]), np.sin(heading[:-1])], -1), 0)])
        return cls(centerline=xy, heading=heading, step_m=step_m)

    def locate(self, xy: np.ndarray) -> tuple[int, float]:
        """Index of the nearest centerline sample and the signed lateral offset (left positive)."""
        d = self.centerline - xy
        i = int(np.argmin(np.einsum("ij,ij->i", d, d)))
        h = self.heading[i]
        lateral = -(d[i, 0] * -math.sin(h) + d[i, 1] * math.cos(h))
        return i, float(lateral)

    def lane_center(self, i: int, lane_offset_m: float) -> np.ndarray:
        h = self.heading[i]
        return self.centerline[i] + lane_offset_m * np.array([-math.sin(h), math.cos(h)])


@dataclass
class Pose2D:
    x: float
    y: float
    yaw: float

    @property
    def xy(self) -> np.ndarray:
        return np.array([self.x, self.y])

    def to_world(self, local_xy: np.ndarray) -> np.ndarray:
        """Points in this pose's frame -> world xy."""
        c, s = math.cos(self.yaw), math.sin(self.yaw)
        return self.xy + local_xy @ np.array([[c, s], [-s, c]])


@dataclass
class Vehicle:
    """Kinematic ego vehicle in the right lane, with clamps that keep it sane.

    follow() moves toward the next point of a planned path; speed, yaw rate and the distance
    from the lane center are limited so nonsense plans cannot drive it off the world.
    """

    road: Road
    pose: Pose2D
    speed: float = 8.0
    min_speed: float = 0.0  # > 0 keeps a plan that stops from stalling a demo for good
    max_speed: float = 15.0
    max_yaw_rate: float = 0.5  # rad/s
    max_lateral_m: float = 3.0  # from the right-lane center
    lane_offset_m: float = -1.75  # right lane (drive on the right)
    clamped_steps: int = field(default=0, init=False)

    @classmethod
    def on_road(cls, road: Road, speed: float = 8.0) -> Vehicle:
        start = road.lane_center(0, cls.lane_offset_m)
        return cls(road=road, pose=Pose2D(float(start[0]), float(start[1]), float(road.heading[0])), speed=speed)

    def cruise(self, dt: float) -> None:
        """Follow the lane at the current speed (before any plan exists)."""
        i, _ = self.road.locate(self.pose.xy)
        ahead = min(i + max(1, int(round(self.speed * 1.0 / self.road.step_m))), len(self.road.centerline) - 1)
        self._step_toward(self.road.lane_center(ahead, self.lane_offset_m), self.speed * dt, dt)

    def follow(self, target_xy: np.ndarray, dt: float) -> None:
        """Advance one step toward target_xy (world), the planned position dt from now."""
        delta = target_xy - self.pose.xy
        along = float(delta @ np.array([math.cos(self.pose.yaw), math.sin(self.pose.yaw)]))
        self._step_toward(target_xy, max(0.0, along), dt)

    def _step_toward(self, target_xy: np.ndarray, distance: float, dt: float) -> None:
        step = min(max(distance, self.min_speed * dt), self.max_speed * dt)
        if abs(step - distance) > 1e-9:
            self.clamped_steps += 1
        delta = target_xy - self.pose.xy
        if float(np.hypot(*delta)) > 1e-6:
            want = math.atan2(delta[1], delta[0])
            turn = (want - self.pose.yaw + math.pi) % (2 * math.pi) - math.pi
            limit = self.max_yaw_rate * dt
            if abs(turn) > limit:
                self.clamped_steps += 1
                turn = math.copysign(limit, turn)
            self.pose.yaw += turn
        self.pose.x += step * math.cos(self.pose.yaw)
        self.pose.y += step * math.sin(self.pose.yaw)
        self.speed = step / dt
        i, lateral = self.road.locate(self.pose.xy)
        off = lateral - self.lane_offset_m
        if abs(off) > self.max_lateral_m:  # pull back toward the lane and face along the road
            self.clamped_steps += 1
            fixed = self.road.lane_center(i, self.lane_offset_m + math.copysign(self.max_lateral_m, off))
            self.pose.x, self.pose.y = float(fixed[0]), float(fixed[1])
            self.pose.yaw = float(self.road.heading[i])


def _clip_near(points_cam: np.ndarray) -> np.ndarray:
    """Clip a polygon (K, 3) in camera coords (z forward) to z >= NEAR_M (Sutherland-Hodgman)."""
    out = []
    for k in range(len(points_cam)):
        a, b = points_cam[k], points_cam[(k + 1) % len(points_cam)]
        a_in, b_in = a[2] >= NEAR_M, b[2] >= NEAR_M
        if a_in:
            out.append(a)
        if a_in != b_in:
            t = (NEAR_M - a[2]) / (b[2] - a[2])
            out.append(a + t * (b - a))
    return np.array(out)


class Renderer:
    """Draws the road world as seen by each camera of a rig."""

    def __init__(self, road: Road, rig: tuple[PinholeCamera, ...]) -> None:
        self.road, self.rig = road, rig
        n = len(road.centerline)
        normal = np.stack([-np.sin(road.heading), np.cos(road.heading)], -1)
        half = road.lane_width_m + 0.5  # two lanes (one each side) plus a shoulder
        self._left = road.centerline + half * normal
        self._right = road.centerline - half * normal

        def stripe(offset_m: float, width_m: float = 0.15) -> tuple[np.ndarray, np.ndarray]:
            return road.centerline + (offset_m + width_m / 2) * normal, road.centerline + (offset_m - width_m / 2) * normal

        self._edges = [stripe(road.lane_width_m), stripe(-road.lane_width_m)]
        self._center = stripe(0.0)
        self._dash = (np.arange(n) * road.step_m) % 6.0 < 3.0
        poles = np.arange(0, n, max(1, int(15 / road.step_m)))
        side = np.where((poles // max(1, int(15 / road.step_m))) % 2 == 0, 1.0, -1.0)
        self._poles = road.centerline[poles] + (half + 1.5) * side[:, None] * normal[poles]

    def _to_camera(self, pose: Pose2D, cam: PinholeCamera, world_xyz: np.ndarray) -> np.ndarray:
        """World points (..., 3) -> camera coords (x right, y down, z forward)."""
        mount = pose.to_world(np.array([[cam.x_m, cam.y_m]]))[0]
        local = _yaw_rotate(world_xyz[..., :2] - mount, pose.yaw + cam.yaw)
        return np.stack([-local[..., 1], cam.z_m - world_xyz[..., 2], local[..., 0]], -1)

    def _project(self, cam: PinholeCamera, pts_cam: np.ndarray) -> np.ndarray:
        fx, fy, cx, cy = cam.intrinsics
        return np.stack([fx * pts_cam[:, 0] / pts_cam[:, 2] + cx, fy * pts_cam[:, 1] / pts_cam[:, 2] + cy], -1)

    def _fill_strip(self, img: np.ndarray, cam: PinholeCamera, a_cam: np.ndarray, b_cam: np.ndarray,
                    keep: np.ndarray, color: tuple[int, int, int]) -> None:
        """Fill the quads between consecutive samples of two ground lines (camera coords).

        Quads wholly in front of the near plane are projected in one batch; the few that
        cross it are clipped one by one.
        """
        quads = np.stack([a_cam[:-1], a_cam[1:], b_cam[1:], b_cam[:-1]], 1)[keep[:-1]]  # (Q, 4, 3)
        if not len(quads):
            return
        zmin = quads[..., 2].min(1)
        visible = quads[(quads[..., 2].max(1) >= NEAR_M) & (zmin <= FAR_M)]
        front = visible[visible[..., 2].min(1) >= NEAR_M]
        polys = []
        if len(front):
            uv = self._project(cam, front.reshape(-1, 3)).reshape(-1, 4, 2)
            polys.extend(np.round(uv * 16).astype(np.int32))
        for quad in visible[visible[..., 2].min(1) < NEAR_M]:
            clipped = _clip_near(quad)
            if len(clipped) >= 3:
                polys.append(np.round(self._project(cam, clipped) * 16).astype(np.int32))
        for poly in polys:  # flat ground of one colour per layer: drawing order does not matter
            cv2.fillConvexPoly(img, poly, color, lineType=cv2.LINE_AA, shift=4)

    def render(self, pose: Pose2D, cam: PinholeCamera) -> np.ndarray:
        """RGB uint8 (height, width, 3) view of camera cam at ego pose."""
        img = np.empty((cam.height, cam.width, 3), np.uint8)
        horizon = int(round(cam.height / 2))
        img[:horizon] = SKY
        img[horizon:] = GRASS
        i, _ = self.road.locate(pose.xy)
        span = int(FAR_M / self.road.step_m)
        window = slice(max(0, i - span), min(len(self.road.centerline), i + span))

        def ground(xy: np.ndarray) -> np.ndarray:
            pts = xy[window]
            return self._to_camera(pose, cam, np.concatenate([pts, np.zeros((len(pts), 1))], 1))

        everything = np.ones(window.stop - window.start, bool)
        self._fill_strip(img, cam, ground(self._left), ground(self._right), everything, ASPHALT)
        for left, right in self._edges:
            self._fill_strip(img, cam, ground(left), ground(right), everything, PAINT)
        self._fill_strip(img, cam, ground(self._center[0]), ground(self._center[1]), self._dash[window], PAINT)
        near = self._poles[np.einsum("ij,ij->i", self._poles - pose.xy, self._poles - pose.xy) < FAR_M ** 2]
        for p in near[np.argsort(-np.linalg.norm(near - pose.xy, axis=1))]:
            base = self._to_camera(pose, cam, np.array([[p[0], p[1], 0.0], [p[0], p[1], 3.0]]))
            if base[0, 2] < NEAR_M:
                continue
            width = 0.3 * cam.fx / base[0, 2]
            (u0, v0), (_, v1) = self._project(cam, base)
            cv2.rectangle(img, (int(u0 - width / 2), int(v1)), (int(u0 + width / 2), int(v0)), POLE, -1)
        return img

    def render_rig(self, pose: Pose2D) -> dict[int, np.ndarray]:
        """Camera index -> image for every camera of the rig."""
        return {cam.index: self.render(pose, cam) for cam in self.rig}
