/*
 * Part 12 of the CRIU shim (criu-shim.c): tmpfs archives written and read in CRIU's own forked
 * child instead of by GNU tar.
 *
 * CRIU saves each tmpfs mount by forking and executing tar, and restores it the same way. Part
 * 6 already took gzip out; what is left is tar's exec and start (its loader, its libraries):
 * about 2 ms an archive inside a dump, three archives in every dump (frozen) and in every
 * restore. Where CRIU's child would exec tar, it writes or reads the archive itself and exits.
 *
 * Only the plain cases are handled here: directories, regular files without holes or other
 * links, symbolic links, device nodes and FIFOs, with names and fields that fit a POSIX ustar
 * header. Sockets are skipped, as GNU tar skips them. Anything else (a hard link, a sparse file,
 * a long name, a file on another mount, an unknown header) is left to GNU tar, with the same
 * arguments: a create rewinds and truncates its output first, an extract looks at every header
 * before it writes anything. What is written is a POSIX ustar archive GNU tar extracts to the
 * same tree; what is read is also GNU tar's own plain output (its "gnu" headers, for images
 * written before this part). GROVE_TMPFS_ARCHIVER=tar in Grove's environment turns it off.
 *
 * The archive is CRIU's image of the sandbox's tmpfs (or the sandbox's tmpfs itself when
 * dumping): names come from the sandbox and are taken as bytes. An extract refuses absolute
 * names and ".." components, and opens every directory on the way with O_NOFOLLOW, so no entry
 * lands outside the target.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "tmpfs-archive.h"

#define BLOCK 512
#define MAX_PATH 4096
/* ustar's numeric fields: octal digits and a NUL. */
#define MAX_ID 07777777L
#define MAX_SIZE 077777777777LL

struct header {
	char name[100];
	char mode[8];
	char uid[8];
	char gid[8];
	char size[12];
	char mtime[12];
	char chksum[8];
	char typeflag;
	char linkname[100];
	char magic[6];
	char version[2];
	char uname[32];
	char gname[32];
	char devmajor[8];
	char devminor[8];
	char prefix[155];
	char pad[12];
};
_Static_assert(sizeof(struct header) == BLOCK, "a ustar header is one block");

/* ---- writing ---- */

struct writer {
	int out;
	char buf[65536];
	size_t used;
};

static int write_all(int fd, const char *p, size_t n)
{
	while (n > 0) {
		ssize_t w = write(fd, p, n);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return -1;
		p += w;
		n -= (size_t)w;
	}
	return 0;
}

static int flush(struct writer *w)
{
	int r = write_all(w->out, w->buf, w->used);
	w->used = 0;
	return r;
}

static int put(struct writer *w, const void *p, size_t n)
{
	if (w->used + n > sizeof(w->buf) && flush(w) < 0)
		return -1;
	if (n > sizeof(w->buf))
		return write_all(w->out, p, n);
	memcpy(w->buf + w->used, p, n);
	w->used += n;
	return 0;
}

/* Zeros up to the next block boundary after `n` bytes of content. */
static int pad(struct writer *w, uint64_t n)
{
	static const char zeros[BLOCK];
	size_t rest = (size_t)((BLOCK - n % BLOCK) % BLOCK);
	return rest ? put(w, zeros, rest) : 0;
}

static int octal(char *field, size_t width, uint64_t v)
{
	/* width - 1 digits, then the NUL */
	char tmp[24];
	int n = snprintf(tmp, sizeof(tmp), "%0*llo", (int)(width - 1), (unsigned long long)v);
	if (n < 0 || (size_t)n != width - 1)
		return -1;
	memcpy(field, tmp, width);
	return 0;
}

/* Puts `path` into name, or prefix "/" name, as ustar splits them. */
static int set_name(struct header *h, const char *path)
{
	size_t len = strlen(path);
	if (len <= sizeof(h->name)) {
		memcpy(h->name, path, len);
		return 0;
	}
	/* the prefix ends at a '/' that leaves at most 100 bytes after it */
	for (size_t i = len - sizeof(h->name) - 1; i < len && i <= sizeof(h->prefix); i++) {
		if (path[i] != '/')
			continue;
		if (i == 0 || len - i - 1 == 0)
			return -1;
		memcpy(h->prefix, path, i);
		memcpy(h->name, path + i + 1, len - i - 1);
		return 0;
	}
	return -1;
}

static int header(struct writer *w, const char *path, const struct stat *st, char type, uint64_t size,
		  const char *link)
{
	struct header h;
	memset(&h, 0, sizeof(h));
	if (set_name(&h, path) < 0 || st->st_uid > MAX_ID || st->st_gid > MAX_ID || st->st_mtime < 0 ||
	    (unsigned long long)st->st_mtime > MAX_SIZE || size > MAX_SIZE)
		return TAR_UNSUPPORTED;
	if (octal(h.mode, sizeof(h.mode), st->st_mode & 07777) < 0 ||
	    octal(h.uid, sizeof(h.uid), st->st_uid) < 0 || octal(h.gid, sizeof(h.gid), st->st_gid) < 0 ||
	    octal(h.size, sizeof(h.size), size) < 0 || octal(h.mtime, sizeof(h.mtime), st->st_mtime) < 0)
		return TAR_UNSUPPORTED;
	h.typeflag = type;
	if (link) {
		size_t n = strlen(link);
		if (n > sizeof(h.linkname))
			return TAR_UNSUPPORTED;
		memcpy(h.linkname, link, n);
	}
	memcpy(h.magic, "ustar", 6);
	memcpy(h.version, "00", 2);
	if (type == '3' || type == '4') {
		if (major(st->st_rdev) > MAX_ID || minor(st->st_rdev) > MAX_ID ||
		    octal(h.devmajor, sizeof(h.devmajor), major(st->st_rdev)) < 0 ||
		    octal(h.devminor, sizeof(h.devminor), minor(st->st_rdev)) < 0)
			return TAR_UNSUPPORTED;
	}
	memset(h.chksum, ' ', sizeof(h.chksum));
	unsigned sum = 0;
	for (size_t i = 0; i < sizeof(h); i++)
		sum += ((unsigned char *)&h)[i];
	snprintf(h.chksum, sizeof(h.chksum), "%06o", sum);
	h.chksum[7] = ' ';
	return put(w, &h, sizeof(h)) < 0 ? -1 : 0;
}

/* A regular file's bytes, exactly `size` of them (the sandbox is frozen: nothing may change). */
static int content(struct writer *w, int dir, const char *name, const char *path, const struct stat *st)
{
	int fd = openat(dir, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0)
		return -1;
	struct stat now;
	int r = fstat(fd, &now) < 0 ? -1 : 0;
	if (r == 0 && (now.st_ino != st->st_ino || now.st_size != st->st_size))
		r = TAR_UNSUPPORTED;
	if (r == 0)
		r = header(w, path, st, '0', (uint64_t)st->st_size, NULL);
	if (r == 0 && st->st_size > 0)
		r = flush(w);
	off_t off = 0;
	while (r == 0 && off < st->st_size) {
		ssize_t n = sendfile(w->out, fd, &off, (size_t)(st->st_size - off));
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			r = -1;
		else if (n == 0)
			r = TAR_UNSUPPORTED; /* shorter than it said */
	}
	close(fd);
	return r == 0 ? pad(w, (uint64_t)st->st_size) : r;
}

static int walk(struct writer *w, int dir, dev_t dev, char *path, size_t len);

static int entry(struct writer *w, int dir, dev_t dev, char *path, size_t len, const char *name)
{
	size_t n = strlen(name);
	if (len + 1 + n + 2 > MAX_PATH)
		return TAR_UNSUPPORTED;
	/* path is "." or "./a/b"; the entry's is path "/" name */
	path[len] = '/';
	memcpy(path + len + 1, name, n + 1);
	size_t at = len + 1 + n;
	struct stat st;
	int r;
	if (fstatat(dir, name, &st, AT_SYMLINK_NOFOLLOW) < 0)
		r = -1;
	else if (st.st_dev != dev)
		r = TAR_UNSUPPORTED; /* another mount: GNU tar knows what --one-file-system wants */
	else if (S_ISDIR(st.st_mode)) {
		int sub = openat(dir, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
		if (sub < 0)
			r = -1;
		else {
			r = walk(w, sub, dev, path, at);
			close(sub);
		}
	} else if (S_ISSOCK(st.st_mode))
		r = 0; /* GNU tar: "socket ignored" */
	else if (st.st_nlink > 1)
		r = TAR_UNSUPPORTED; /* a hard link: GNU tar writes the second one as a link */
	else if (S_ISREG(st.st_mode))
		r = (uint64_t)st.st_blocks * 512 < (uint64_t)st.st_size ? TAR_UNSUPPORTED /* holes: --sparse */
									   : content(w, dir, name, path, &st);
	else if (S_ISLNK(st.st_mode)) {
		char target[101];
		ssize_t t = readlinkat(dir, name, target, sizeof(target));
		if (t < 0)
			r = -1;
		else if ((size_t)t >= sizeof(target) || t != st.st_size)
			r = TAR_UNSUPPORTED;
		else {
			target[t] = 0;
			r = header(w, path, &st, '2', 0, target);
		}
	} else if (S_ISCHR(st.st_mode))
		r = header(w, path, &st, '3', 0, NULL);
	else if (S_ISBLK(st.st_mode))
		r = header(w, path, &st, '4', 0, NULL);
	else if (S_ISFIFO(st.st_mode))
		r = header(w, path, &st, '6', 0, NULL);
	else
		r = TAR_UNSUPPORTED;
	path[len] = 0;
	return r;
}

/* Writes the directory open at `dir` (named `path`, `len` bytes), then what it holds. */
static int walk(struct writer *w, int dir, dev_t dev, char *path, size_t len)
{
	struct stat st;
	if (fstat(dir, &st) < 0)
		return -1;
	path[len] = '/';
	path[len + 1] = 0;
	int r = header(w, path, &st, '5', 0, NULL);
	path[len] = 0;
	if (r != 0)
		return r;
	int fd = dup(dir);
	DIR *d = fd < 0 ? NULL : fdopendir(fd);
	if (!d) {
		if (fd >= 0)
			close(fd);
		return -1;
	}
	struct dirent *e;
	errno = 0;
	while (r == 0 && (e = readdir(d))) {
		if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
			continue;
		r = entry(w, dir, dev, path, len, e->d_name);
		errno = 0;
	}
	if (r == 0 && errno != 0)
		r = -1;
	closedir(d);
	return r;
}

int tar_create(int dir, int out)
{
	struct stat root, o;
	if (fstat(dir, &root) < 0 || !S_ISDIR(root.st_mode) || fstat(out, &o) < 0 || !S_ISREG(o.st_mode))
		return TAR_UNSUPPORTED;
	off_t start = lseek(out, 0, SEEK_CUR);
	if (start < 0)
		return TAR_UNSUPPORTED;
	struct writer *w = calloc(1, sizeof(*w));
	char *path = malloc(MAX_PATH);
	int r = -1;
	if (w && path) {
		w->out = out;
		strcpy(path, ".");
		r = walk(w, dir, root.st_dev, path, 1);
		if (r == 0) {
			static const char end[2 * BLOCK];
			r = put(w, end, sizeof(end)) < 0 || flush(w) < 0 ? -1 : 0;
		}
	}
	free(w);
	free(path);
	if (r != 0 && (ftruncate(out, start) < 0 || lseek(out, start, SEEK_SET) != start))
		return -1; /* cannot be undone: GNU tar would append to half an archive */
	return r == 0 ? 0 : TAR_UNSUPPORTED;
}

/* ---- reading ---- */

struct member {
	char path[256 + 2]; /* prefix "/" name, NUL */
	char link[101];
	char type;
	mode_t mode;
	uid_t uid;
	gid_t gid;
	uint64_t size;
	time_t mtime;
	dev_t rdev;
	off_t data; /* where its bytes start in the archive */
};

/* A NUL- or space-ended octal field; -1 if it is not one. */
static long long field(const char *p, size_t n)
{
	long long v = 0;
	size_t i = 0;
	while (i < n && p[i] == ' ')
		i++;
	if (i == n)
		return -1;
	for (; i < n && p[i] >= '0' && p[i] <= '7'; i++) {
		if (v > (MAX_SIZE >> 3))
			return -1;
		v = v * 8 + (p[i] - '0');
	}
	if (i < n && p[i] != 0 && p[i] != ' ')
		return -1;
	return v;
}

static void copy_str(char *to, const char *from, size_t n)
{
	memcpy(to, from, n);
	to[n] = 0;
}

/*
 * The header at `off`: 1 with `m` filled in, 0 at the end of the archive, -1 for anything this
 * reader leaves to GNU tar.
 */
static int read_member(int in, off_t off, off_t end, struct member *m)
{
	unsigned char b[BLOCK];
	if (off + BLOCK > end || pread(in, b, BLOCK, off) != BLOCK)
		return -1;
	int zero = 1;
	for (size_t i = 0; i < BLOCK && zero; i++)
		zero = b[i] == 0;
	if (zero)
		return 0;
	const struct header *h = (const struct header *)b;
	long long sum = field(h->chksum, sizeof(h->chksum));
	long long got = 0;
	for (size_t i = 0; i < BLOCK; i++)
		got += (i >= offsetof(struct header, chksum) && i < offsetof(struct header, typeflag)) ? ' ' : b[i];
	if (sum != got)
		return -1;
	/* POSIX ustar (ours), or GNU tar's own: its "prefix" is not a prefix, but unused here */
	int ustar = memcmp(h->magic, "ustar", 6) == 0 && memcmp(h->version, "00", 2) == 0;
	int gnu = memcmp(h->magic, "ustar ", 6) == 0 && memcmp(h->version, " ", 2) == 0;
	if (!ustar && !gnu)
		return -1;
	memset(m, 0, sizeof(*m));
	char name[101], prefix[156] = "";
	copy_str(name, h->name, sizeof(h->name));
	if (ustar)
		copy_str(prefix, h->prefix, sizeof(h->prefix));
	if (prefix[0])
		snprintf(m->path, sizeof(m->path), "%s/%s", prefix, name);
	else
		snprintf(m->path, sizeof(m->path), "%s", name);
	copy_str(m->link, h->linkname, sizeof(h->linkname));
	m->type = h->typeflag ? h->typeflag : '0';
	long long mode = field(h->mode, sizeof(h->mode)), uid = field(h->uid, sizeof(h->uid)),
		  gid = field(h->gid, sizeof(h->gid)), size = field(h->size, sizeof(h->size)),
		  mtime = field(h->mtime, sizeof(h->mtime));
	if (mode < 0 || uid < 0 || gid < 0 || size < 0 || mtime < 0)
		return -1;
	m->mode = (mode_t)(mode & 07777);
	m->uid = (uid_t)uid;
	m->gid = (gid_t)gid;
	m->mtime = (time_t)mtime;
	m->data = off + BLOCK;
	switch (m->type) {
	case '0':
		m->size = (uint64_t)size;
		break;
	case '3':
	case '4': {
		long long maj = field(h->devmajor, sizeof(h->devmajor)), min = field(h->devminor, sizeof(h->devminor));
		if (maj < 0 || min < 0)
			return -1;
		m->rdev = makedev((unsigned)maj, (unsigned)min);
		break;
	}
	case '2':
	case '5':
	case '6':
		break;
	default:
		return -1; /* hard links, long names, sparse files, pax headers... */
	}
	if (m->type != '0' && size != 0)
		return -1;
	if ((uint64_t)m->data + ((m->size + BLOCK - 1) / BLOCK) * BLOCK > (uint64_t)end)
		return -1;
	return 1;
}

/*
 * The entry's path without "./" and trailing slashes, checked: relative, no ".." component.
 * Returns 0 and sets *rel ("" for the root itself), or -1.
 */
static int relative(struct member *m, char **rel)
{
	char *p = m->path;
	size_t n = strlen(p);
	while (n > 0 && p[n - 1] == '/')
		p[--n] = 0;
	if (p[0] == '/')
		return -1;
	while (p[0] == '.' && (p[1] == '/' || p[1] == 0))
		p += p[1] ? 2 : 1;
	for (char *c = p; *c;) {
		char *slash = strchr(c, '/');
		size_t len = slash ? (size_t)(slash - c) : strlen(c);
		if ((len == 2 && c[0] == '.' && c[1] == '.') || len == 0 || (len == 1 && c[0] == '.'))
			return -1;
		c += len + (slash ? 1 : 0);
	}
	*rel = p;
	return 0;
}

/* Opens the directory holding `rel` (under `root`), not following links; sets *base. */
static int parent_of(int root, char *rel, const char **base)
{
	int dir = dup(root);
	char *c = rel;
	char *slash;
	while (dir >= 0 && (slash = strchr(c, '/'))) {
		*slash = 0;
		int next = openat(dir, c, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
		*slash = '/';
		close(dir);
		dir = next;
		c = slash + 1;
	}
	*base = c;
	return dir;
}

static int copy_out(int in, off_t from, int fd, uint64_t size)
{
	off_t off = from;
	uint64_t left = size;
	while (left > 0) {
		ssize_t n = sendfile(fd, in, &off, left);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return -1;
		left -= (uint64_t)n;
	}
	return 0;
}

static const struct timespec *stat_times(const struct member *m, struct timespec t[2])
{
	t[0] = (struct timespec){ .tv_nsec = UTIME_NOW };
	t[1] = (struct timespec){ .tv_sec = m->mtime };
	return t;
}

/* A file's or directory's owner, mode and times, as GNU tar sets them as root (chown first: it
 * clears set-id bits). */
static int set_stat(int fd, const struct member *m)
{
	struct timespec t[2];
	return fchown(fd, m->uid, m->gid) < 0 || fchmod(fd, m->mode) < 0 || futimens(fd, stat_times(m, t)) < 0 ? -1 : 0;
}

/* The same for a link, device or FIFO just made as `base` in `dir` (not followed; a link has no mode). */
static int set_stat_at(int dir, const char *base, const struct member *m)
{
	struct timespec t[2];
	if (fchownat(dir, base, m->uid, m->gid, AT_SYMLINK_NOFOLLOW) < 0)
		return -1;
	if (m->type != '2' && fchmodat(dir, base, m->mode, 0) < 0)
		return -1;
	return utimensat(dir, base, stat_times(m, t), AT_SYMLINK_NOFOLLOW) < 0 ? -1 : 0;
}

/* Makes one entry; a directory's own stat waits for the end (its entries change its mtime). */
static int extract_one(int in, int root, struct member *m, char *rel)
{
	if (!rel[0])
		return m->type == '5' ? 0 : -1;
	const char *base;
	int dir = parent_of(root, rel, &base);
	if (dir < 0)
		return -1;
	int r = -1, fd = -1;
	for (int attempt = 0; attempt < 2 && r < 0; attempt++) {
		switch (m->type) {
		case '5':
			r = mkdirat(dir, base, 0700);
			if (r < 0 && errno == EEXIST) {
				struct stat st;
				r = fstatat(dir, base, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode) ? 0 : -1;
				errno = EEXIST;
			}
			break;
		case '0':
			fd = openat(dir, base, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
			r = fd < 0 ? -1 : 0;
			break;
		case '2':
			r = symlinkat(m->link, dir, base);
			break;
		default:
			r = mknodat(dir, base,
				    (m->type == '3' ? S_IFCHR : m->type == '4' ? S_IFBLK : S_IFIFO) | 0600, m->rdev);
		}
		/* something else already there: replaced, as GNU tar does */
		if (r == 0 || errno != EEXIST || attempt == 1 || unlinkat(dir, base, 0) < 0)
			break;
	}
	if (r == 0 && m->type == '0')
		r = copy_out(in, m->data, fd, m->size) < 0 || set_stat(fd, m) < 0 ? -1 : 0;
	else if (r == 0 && m->type != '5')
		r = set_stat_at(dir, base, m);
	if (fd >= 0)
		close(fd);
	close(dir);
	return r;
}

/* Every directory's owner, mode and times, children before parents, the root last. */
static int finish_dirs(int in, int root, off_t first, off_t end)
{
	/* the headers again, backwards: collect the offsets first */
	size_t n = 0, cap = 64;
	off_t *at = malloc(cap * sizeof(*at));
	struct member m;
	int r = at ? 0 : -1;
	for (off_t off = first; r == 0;) {
		int got = read_member(in, off, end, &m);
		if (got <= 0) {
			r = got;
			break;
		}
		if (m.type == '5') {
			if (n == cap) {
				off_t *more = realloc(at, 2 * cap * sizeof(*at));
				if (!more) {
					r = -1;
					break;
				}
				at = more;
				cap *= 2;
			}
			at[n++] = off;
		}
		off = m.data + (off_t)(((m.size + BLOCK - 1) / BLOCK) * BLOCK);
	}
	while (r == 0 && n > 0) {
		char *rel;
		if (read_member(in, at[--n], end, &m) != 1 || relative(&m, &rel) < 0) {
			r = -1;
			break;
		}
		int fd = rel[0] ? openat(root, rel, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC) : dup(root);
		if (fd < 0)
			r = -1;
		else {
			r = set_stat(fd, &m);
			close(fd);
		}
	}
	free(at);
	return r;
}

int tar_extract(int in, const char *target)
{
	struct stat st;
	if (fstat(in, &st) < 0 || !S_ISREG(st.st_mode))
		return TAR_UNSUPPORTED;
	off_t first = lseek(in, 0, SEEK_CUR);
	if (first < 0)
		return TAR_UNSUPPORTED;
	off_t end = st.st_size;
	/* every header first: nothing is written unless this reader can take all of them */
	struct member m;
	off_t off = first;
	for (;;) {
		int got = read_member(in, off, end, &m);
		if (got == 0)
			break;
		char *rel;
		if (got < 0 || relative(&m, &rel) < 0)
			return TAR_UNSUPPORTED;
		off = m.data + (off_t)(((m.size + BLOCK - 1) / BLOCK) * BLOCK);
	}
	int root = open(target, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (root < 0)
		return TAR_UNSUPPORTED;
	int r = 0;
	for (off = first; r == 0;) {
		int got = read_member(in, off, end, &m);
		if (got <= 0) {
			r = got;
			break;
		}
		char *rel;
		r = relative(&m, &rel) < 0 ? -1 : extract_one(in, root, &m, rel);
		off = m.data + (off_t)(((m.size + BLOCK - 1) / BLOCK) * BLOCK);
	}
	if (r == 0)
		r = finish_dirs(in, root, first, end);
	close(root);
	return r == 0 ? 0 : TAR_UNSUPPORTED;
}
