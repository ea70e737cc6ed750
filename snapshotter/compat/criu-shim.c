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
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
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
