"""The host side of pods: a relay to the pod layer inside a capsule (``pods/``, through the guest
agent), the pod operations, and pod images as sealed file objects in the store."""

POD_IMAGE_ROLE = "pod-image"  # the role of a pod image among the store's file objects
POD_GROUP_ROLE = "pod-group"  # a group image (capsule pod checkpoint-group): its members' pod images
