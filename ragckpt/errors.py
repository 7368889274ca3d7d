"""Error types. Every message is one line that names the object and says what to do."""


class RagckptError(Exception):
    """Base class for every error ragckpt raises on purpose."""


class LayoutError(RagckptError, ValueError):
    """A placement or layout is inconsistent (units do not divide, wrong world size, ...)."""


class UnknownNameError(LayoutError, KeyError):
    """A tensor or buffer name that the checkpoint or layout does not hold. Also a KeyError, since
    a name lookup failed; printed without KeyError's quotes."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class OutOfRangeError(LayoutError, IndexError):
    """A rank or element range outside what the checkpoint or layout holds."""


class OptionError(RagckptError, ValueError):
    """An argument outside its range (a memory budget too small, zero workers)."""


#: what to do with PyTorch .bin (pickled) model weights, which nothing here reads
RESAVE_BIN_WEIGHTS = "re-save them as safetensors (transformers: save_pretrained(..., safe_serialization=True))"


class FormatError(RagckptError):
    """Checkpoint metadata is missing, malformed or of an unknown version."""


class NotCommittedError(FormatError):
    """The checkpoint has no commit marker: a save was interrupted or is still running."""


class IntegrityError(RagckptError):
    """Stored bytes do not match their checksum or size."""


class CorruptMarkerError(IntegrityError, FormatError):
    """The commit marker is there but unreadable, or describes another checkpoint: damage, as a bad
    checksum is (so `verify` judges it BAD), and malformed metadata to code that catches FormatError."""


class StorageError(RagckptError):
    """The storage backend failed permanently for a URL."""


class BadObjectError(StorageError):
    """The object itself is wrong: missing, shorter than it must be, or not a regular object (a
    directory, a pipe, a dangling link). That is damage to what is stored, which restoring the object
    cures. Any other StorageError says nothing about what is stored: the store did not answer as it
    should (an outage, throttling, refused credentials), or the URL or storage settings are wrong."""


class AccessDeniedError(StorageError):
    """The store refused a request for its credentials or permissions."""


class DestinationError(RagckptError):
    """Refusing a destination: empty, overlapping the source, or not a directory."""


class DestinationReplacedError(DestinationError):
    """The destination directory was replaced (another job's --overwrite set it aside) while this
    job wrote into it: this job stops before its writes can land in the other job's tree."""


class DestinationExistsError(DestinationError):
    """Refusing to overwrite an existing checkpoint or non-empty destination."""
