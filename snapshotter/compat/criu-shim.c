/*
 * Preloaded into CRIU 4.1; two fixes, each a no-op where CRIU does not hit its bug.
 *
 * 1. Socket options. Kernels >= 6.16 restrict SO_PASSCRED/SO_PASSSEC to AF_UNIX/AF_NETLINK
 *    sockets and answer EOPNOTSUPP elsewhere (checkpoint-restore/criu#2705). CRIU 4.1 treats
 *    that as a fatal dump error for every TCP/UDP socket; these options are meaningless on such
 *    sockets, so report them as off, and accept "off" when restoring. Newer CRIU releases do
 *    the same internally.
 *
 * 2. setns into the mount namespace the caller is already in. To restore a unix socket bound to
 *    a path, CRIU switches the restoring task into the socket's mount namespace. When the tree
 *    has a dead session leader (any `cmd &` left behind by a shell that exited), CRIU forks a
 *    helper task for that session with CLONE_FS from the root task, and the kernel refuses a
 *    mount-namespace setns from a task whose fs_struct is shared (EINVAL). The root task (Grove's
 *    init, whose control socket is bound in /run/grove) is then already in the namespace it asks
 *    for, so the switch is a no-op: answer success when, and only when, the target namespace is
 *    the caller's own.
 *
 * And one speed-up, active only when Grove sets GROVE_CRIU_KDAT:
 *
 * 3. CRIU's kernel-feature cache. CRIU probes the kernel on every run (about 30 ms here) unless
 *    it finds /run/criu.kdat, which it writes only where /run is a tmpfs (the cache must not
 *    outlive a reboot). On hosts whose /run is not one, GROVE_CRIU_KDAT names a file on a tmpfs
 *    and CRIU's open/rename/unlink of /run/criu.kdat and /run/criu.kdat.tmp go there instead.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sched.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>

#ifndef SO_PASSSEC
#define SO_PASSSEC 34
#endif

static int is_pass_opt(int level, int name)
{
	return level == SOL_SOCKET && (name == SO_PASSCRED || name == SO_PASSSEC);
}

int getsockopt(int fd, int level, int name, void *val, socklen_t *len)
{
	static int (*real)(int, int, int, void *, socklen_t *);
	if (!real)
		real = (int (*)(int, int, int, void *, socklen_t *))dlsym(RTLD_NEXT, "getsockopt");
	int r = real(fd, level, name, val, len);
	if (r < 0 && errno == EOPNOTSUPP && is_pass_opt(level, name) && val && len &&
	    *len >= sizeof(int)) {
		memset(val, 0, sizeof(int));
		*len = sizeof(int);
		errno = 0;
		return 0;
	}
	return r;
}

int setsockopt(int fd, int level, int name, const void *val, socklen_t len)
{
	static int (*real)(int, int, int, const void *, socklen_t);
	if (!real)
		real = (int (*)(int, int, int, const void *, socklen_t))dlsym(RTLD_NEXT, "setsockopt");
	int r = real(fd, level, name, val, len);
	if (r < 0 && errno == EOPNOTSUPP && is_pass_opt(level, name) && val &&
	    len >= sizeof(int) && *(const int *)val == 0) {
		errno = 0;
		return 0;
	}
	return r;
}

static int is_own_mount_ns(int fd)
{
	struct stat target, own;
	if (fstat(fd, &target) < 0 || stat("/proc/self/ns/mnt", &own) < 0)
		return 0;
	return target.st_dev == own.st_dev && target.st_ino == own.st_ino;
}

int setns(int fd, int nstype)
{
	static int (*real)(int, int);
	if (!real)
		real = (int (*)(int, int))dlsym(RTLD_NEXT, "setns");
	int r = real(fd, nstype);
	if (r < 0 && errno == EINVAL && (nstype == CLONE_NEWNS || nstype == 0) &&
	    is_own_mount_ns(fd)) {
		errno = 0;
		return 0;
	}
	return r;
}

static const char *kdat_path(const char *path, char *buf, size_t len)
{
	const char *to = getenv("GROVE_CRIU_KDAT");
	if (!to || !path)
		return path;
	if (strcmp(path, "/run/criu.kdat") == 0)
		return to;
	if (strcmp(path, "/run/criu.kdat.tmp") == 0 && snprintf(buf, len, "%s.tmp", to) < (int)len)
		return buf;
	return path;
}

#define KDAT_OPEN(name)                                                                   \
	int name(const char *path, int flags, ...)                                        \
	{                                                                                 \
		static int (*real)(const char *, int, ...);                               \
		if (!real)                                                                \
			real = (int (*)(const char *, int, ...))dlsym(RTLD_NEXT, #name);  \
		mode_t mode = 0;                                                          \
		if (flags & (O_CREAT | O_TMPFILE)) {                                      \
			va_list ap;                                                       \
			va_start(ap, flags);                                              \
			mode = va_arg(ap, mode_t);                                        \
			va_end(ap);                                                       \
		}                                                                         \
		char buf[4096];                                                           \
		return real(kdat_path(path, buf, sizeof(buf)), flags, mode);              \
	}
KDAT_OPEN(open)
KDAT_OPEN(open64)

int rename(const char *from, const char *to)
{
	static int (*real)(const char *, const char *);
	if (!real)
		real = (int (*)(const char *, const char *))dlsym(RTLD_NEXT, "rename");
	char a[4096], b[4096];
	return real(kdat_path(from, a, sizeof(a)), kdat_path(to, b, sizeof(b)));
}

int unlink(const char *path)
{
	static int (*real)(const char *);
	if (!real)
		real = (int (*)(const char *))dlsym(RTLD_NEXT, "unlink");
	char buf[4096];
	return real(kdat_path(path, buf, sizeof(buf)));
}
