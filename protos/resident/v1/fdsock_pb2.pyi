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

class FdRequest(_message.Message):
    __slots__ = ("hello", "fetch_fds")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    FETCH_FDS_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    fetch_fds: FetchFds
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., fetch_fds: _Optional[_Union[FetchFds, _Mapping]] = ...) -> None: ...

class FdReply(_message.Message):
    __slots__ = ("hello", "fds", "error")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    FDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    hello: HelloReply
    fds: FdsFollow
    error: Error
    def __init__(self, hello: _Optional[_Union[HelloReply, _Mapping]] = ..., fds: _Optional[_Union[FdsFollow, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

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
