"""An encrypted, deduplicated capsule repository on S3-compatible object storage (restic's design: packs,
indexes, version records; borg's keyed block ids). Layouts: :mod:`capsule.repo.format`; keys and sealing:
:mod:`capsule.repo.crypto`; the object store: :mod:`capsule.repo.s3`."""
