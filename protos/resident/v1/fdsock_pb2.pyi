from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Hello(_message.Message):
    __slots__ = ("protocol_major", "protocol_minor", "client_name", "client_version")
    PROTOCOL_MAJOR_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_MINOR_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol_major: int
    protocol_minor: int
    client_name: str
    client_version: str
    def __init__(self, protocol_major: _Optional[int] = ..., protocol_minor: _Optional[int] = ..., client_name: _Optional[str] = ..., client_version: _Optional[str] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("protocol_major", "protocol_minor", "session_token", "daemon_pid", "daemon_version", "uid", "gid", "pid", "admin")
    PROTOCOL_MAJOR_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_MINOR_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DAEMON_PID_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    protocol_major: int
    protocol_minor: int
    session_token: str
    daemon_pid: int
    daemon_version: str
    uid: int
    gid: int
    pid: int
    admin: bool
    def __init__(self, protocol_major: _Optional[int] = ..., protocol_minor: _Optional[int] = ..., session_token: _Optional[str] = ..., daemon_pid: _Optional[int] = ..., daemon_version: _Optional[str] = ..., uid: _Optional[int] = ..., gid: _Optional[int] = ..., pid: _Optional[int] = ..., admin: _Optional[bool] = ...) -> None: ...

class FetchFds(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class Takeover(_message.Message):
    __slots__ = ("state_format_major", "daemon_version", "pid")
    STATE_FORMAT_MAJOR_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    state_format_major: int
    daemon_version: str
    pid: int
    def __init__(self, state_format_major: _Optional[int] = ..., daemon_version: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class TakeoverCommit(_message.Message):
    __slots__ = ("pid",)
    PID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    def __init__(self, pid: _Optional[int] = ...) -> None: ...

class TakeoverAbort(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class FdRequest(_message.Message):
    __slots__ = ("hello", "fetch_fds", "takeover", "takeover_commit", "takeover_abort")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    FETCH_FDS_FIELD_NUMBER: _ClassVar[int]
    TAKEOVER_FIELD_NUMBER: _ClassVar[int]
    TAKEOVER_COMMIT_FIELD_NUMBER: _ClassVar[int]
    TAKEOVER_ABORT_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    fetch_fds: FetchFds
    takeover: Takeover
    takeover_commit: TakeoverCommit
    takeover_abort: TakeoverAbort
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., fetch_fds: _Optional[_Union[FetchFds, _Mapping]] = ..., takeover: _Optional[_Union[Takeover, _Mapping]] = ..., takeover_commit: _Optional[_Union[TakeoverCommit, _Mapping]] = ..., takeover_abort: _Optional[_Union[TakeoverAbort, _Mapping]] = ...) -> None: ...

class TakeoverFds(_message.Message):
    __slots__ = ("names", "last", "state_format_major", "daemon_version", "backend")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    STATE_FORMAT_MAJOR_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    last: bool
    state_format_major: int
    daemon_version: str
    backend: str
    def __init__(self, names: _Optional[_Iterable[str]] = ..., last: _Optional[bool] = ..., state_format_major: _Optional[int] = ..., daemon_version: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class TakeoverDone(_message.Message):
    __slots__ = ("pid",)
    PID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    def __init__(self, pid: _Optional[int] = ...) -> None: ...

class FdReply(_message.Message):
    __slots__ = ("hello", "fds", "error", "takeover_fds", "takeover_done")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    FDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TAKEOVER_FDS_FIELD_NUMBER: _ClassVar[int]
    TAKEOVER_DONE_FIELD_NUMBER: _ClassVar[int]
    hello: HelloReply
    fds: FdsFollow
    error: Error
    takeover_fds: TakeoverFds
    takeover_done: TakeoverDone
    def __init__(self, hello: _Optional[_Union[HelloReply, _Mapping]] = ..., fds: _Optional[_Union[FdsFollow, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., takeover_fds: _Optional[_Union[TakeoverFds, _Mapping]] = ..., takeover_done: _Optional[_Union[TakeoverDone, _Mapping]] = ...) -> None: ...

class FdsFollow(_message.Message):
    __slots__ = ("lease_id", "fd_slabs")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    FD_SLABS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    fd_slabs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[str] = ..., fd_slabs: _Optional[_Iterable[int]] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
