"""The `.ninfer` container: framing, directory schema, reader (mmap, parts) and streaming writer."""

from ninfer.artifact.reader import Artifact, DigestError, open_artifact
from ninfer.artifact.writer import ArtifactWriter, ResourceSpec, TensorSpec, plan_objects, write_artifact

__all__ = ["Artifact", "ArtifactWriter", "DigestError", "ResourceSpec", "TensorSpec", "open_artifact", "plan_objects",
           "write_artifact"]
