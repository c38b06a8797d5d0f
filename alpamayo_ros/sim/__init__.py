"""AlpaSim's egodriver gRPC contract served on the drive loop (`alpamayo-egodriver`).

The wire is NVlabs/alpasim's `egodriver.EgodriverService`, through the generated modules of
carla-driver-interface (which vendors alpasim's protos unchanged); every session runs its own
drive loop with the node's input assembly, and all sessions share one model.
"""
