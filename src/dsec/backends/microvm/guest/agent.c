/*
 * dsec microVM guest agent: PID 1 of the guest (exec'd by /init).
 *
 *     agent PORT ROOT      e.g.  agent /dev/virtio-ports/dsec.agent /sysroot
 *                                 agent vsock:1024 /sysroot
 *                                 agent unix:/tmp/agent.sock /   (tests, on the host)
 *
 * Speaks the protocol of PROTOCOL.md (next to this file) with the host over the virtio-serial
 * PORT, or over one AF_VSOCK connection at a time accepted on the given vsock port: spawns processes chrooted in ROOT with their stdio streamed, signals them, and does
 * file operations inside ROOT. Single-threaded: one poll() loop over the port, the signalfd
 * (SIGCHLD) and every spawned process's stdio pipes. As PID 1 it reaps every child (orphans
 * are reparented to it) and never exits: PID 1 exiting panics the kernel.
 *
 * Build (Debian 12): gcc -static -O2 -Wall -Wextra -Werror -o agent agent.c
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <linux/capability.h>
#include <linux/landlock.h>
#include <linux/openat2.h>
#include <linux/vm_sockets.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/reboot.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define VERSION "dsec-agent 3"
#define MAX_PAYLOAD (1u << 20) /* largest payload of a frame, either direction */
#define HDR 9                  /* u32 len, u8 type, u32 chan */
#define CHUNK 65536            /* pipe and file reads are forwarded in pieces of this size */
#define DEFAULT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

enum { T_SPAWN = 1, T_STDIN, T_KILL, T_FOP, T_DATA, T_COMMIT, T_ABORT, T_PING, T_WATCH };
enum { R_READY = 0x80, R_STARTED, R_STDOUT, R_STDERR, R_FRES, R_DATA, R_EXIT, R_OOM,
       R_PONG = 0x88, R_WATCHED, R_ERROR = 0x8f };
enum { W_CALIBRATE = 1, W_CHECK, W_MARK };           /* WATCH's ops */
enum { W_NO = 0, W_YES, W_UNWATCHED };               /* WATCHED's answers */
enum { OP_STAT = 1, OP_LIST, OP_MKDIR, OP_REMOVE, OP_READ, OP_WRITE, OP_RENAME };

/* A spawned process, from SPAWN until its EXIT frame is sent. */
struct proc {
	struct proc *next;
	uint32_t chan;
	pid_t pid;
	int in, out, err;       /* our ends of its stdio pipes (non-blocking), -1 once closed */
	int reaped, status;     /* waitpid() done, and its raw status */
	int done;               /* EXIT sent: freed at the end of the loop iteration */
	unsigned char *q;       /* STDIN bytes the pipe did not take yet: q[qoff..qlen) */
	size_t qlen, qoff;
	int close_in;           /* an empty STDIN came: close stdin once q is drained */
	char rest[160];         /* a watched shell's /proc/PID/syscall while it waits for a
				 * command (WATCH CALIBRATE); empty if not watched */
};

/* A READ being streamed: one CHUNK per loop iteration, so a big file does not starve the rest. */
struct rd {
	struct rd *next;
	uint32_t chan;
	int fd;
};

/* A WRITE in progress: DATA goes to a temporary file that COMMIT renames over the target. */
struct wr {
	struct wr *next;
	uint32_t chan;
	int dir, fd, err;       /* parent directory (O_PATH), temp file, first write error */
	char tmp[NAME_MAX + 1], name[NAME_MAX + 1];
};

static struct rlimit nofile; /* RLIMIT_NOFILE as we got it: children get it back */
static const char *root_path;
static int root_fd = -1, port_fd = -1, sig_fd = -1, vmstat_fd = -1;
/* vsock mode: the listening socket (port_fd is then the accepted host connection, -1 while
 * none), and a count of connections so a poll result is never applied to a later one. */
static int listen_fd = -1;
static unsigned conn_gen;
static uint64_t oom_sent; /* the guest kernel's OOM kill count as last sent to the host */
static struct proc *procs;
static struct rd *reads;
static struct wr *writes;

/* rx holds bytes read from the port: at most one partial frame plus one read's worth. */
static unsigned char rx[HDR + MAX_PAYLOAD + CHUNK];
static size_t rx_len;
static unsigned char tx[HDR + MAX_PAYLOAD];
static int landlock_abi; /* the kernel's Landlock ABI version, 0 without Landlock */

static void logmsg(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fputs("dsec-agent: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
}

/* Unrecoverable setup failure: power off so the host sees the VM end instead of a hang. */
static void fatal(const char *what)
{
	logmsg("fatal: %s: %s", what, strerror(errno));
	sync();
	reboot(RB_POWER_OFF);
	for (;;)
		pause();
}

static void put32(unsigned char *p, uint32_t v)
{
	p[0] = v; p[1] = v >> 8; p[2] = v >> 16; p[3] = v >> 24;
}

static void put64(unsigned char *p, uint64_t v)
{
	put32(p, (uint32_t)v);
	put32(p + 4, (uint32_t)(v >> 32));
}

static uint32_t get32(const unsigned char *p)
{
	return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24;
}

/* ---- port output ---------------------------------------------------------------------- */

static uint64_t oom_count(void);

/* vsock mode: the host's connection ended (closed, or reset by a snapshot restore). */
static void host_gone(void)
{
	close(port_fd);
	port_fd = -1;
	rx_len = 0; /* the next connection starts on a frame boundary */
	conn_gen++;
}

/*
 * vsock mode: wait for the host to connect (blocking: as a virtio-serial write waits for a
 * host, this holds output back while none is connected), then greet it as a virtio-serial
 * host is greeted when the agent starts: READY, then the OOM count. A host that reconnects
 * skips both (it waits for the PONG of its PING). Uses its own buffer: the frame a caller was
 * about to send may be in tx already.
 */
static void accept_host(void)
{
	unsigned char b[2 * HDR + sizeof VERSION + 8];
	uint64_t oom = oom_count();
	size_t n = 0;

	while ((port_fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC)) < 0) {
		if (errno != EINTR && errno != ECONNABORTED) {
			logmsg("accept: %s", strerror(errno));
			poll(NULL, 0, 100);
		}
	}
	conn_gen++;
	put32(b, 5 + sizeof VERSION);
	b[4] = R_READY;
	put32(b + 5, 0);
	memcpy(b + HDR, VERSION, sizeof VERSION);
	n = HDR + sizeof VERSION;
	put32(b + n, 5 + 8);
	b[n + 4] = R_OOM;
	put32(b + n + 5, 0);
	put64(b + n + HDR, oom);
	n += HDR + 8;
	oom_sent = oom;
	for (size_t off = 0; off < n;) {
		ssize_t w = write(port_fd, b + off, n - off);
		if (w > 0) {
			off += (size_t)w;
		} else if (w < 0 && errno != EINTR) {
			host_gone(); /* it went away at once: wait for the next one */
			accept_host();
			return;
		}
	}
}

/*
 * Writes a whole buffer to the port. The port is a blocking fd (we only read it after poll()
 * says POLLIN), so this waits while the host is slow or not connected; that is the
 * back-pressure: meanwhile spawned processes block on full pipes. A virtio port write takes
 * at most 32 KiB at a time, hence the loop.
 */
static void port_write(const unsigned char *p, size_t n)
{
	while (n > 0) {
		ssize_t w = write(port_fd, p, n);
		if (w > 0) {
			p += w;
			n -= (size_t)w;
		} else if (w == 0 || errno == EAGAIN) {
			poll(&(struct pollfd){ .fd = port_fd, .events = POLLOUT }, 1, 100);
		} else if (errno != EINTR) {
			logmsg("port write: %s (frame dropped)", strerror(errno));
			/* vsock: the host is gone. The rest of this frame must not start the next
			 * connection (its framing would be lost): drop it. */
			if (listen_fd >= 0)
				host_gone();
			return;
		}
	}
}

static void send_frame(int type, uint32_t chan, const void *data, size_t n)
{
	if (listen_fd >= 0 && port_fd < 0)
		accept_host(); /* before tx is touched: data may point into it */
	put32(tx, (uint32_t)n + 5);
	tx[4] = type;
	put32(tx + 5, chan);
	if (n > 0 && data != tx + HDR)
		memmove(tx + HDR, data, n);
	port_write(tx, HDR + n);
}

static void send_i32(int type, uint32_t chan, int32_t v)
{
	unsigned char b[4];
	put32(b, (uint32_t)v);
	send_frame(type, chan, b, 4);
}

static void send_error(uint32_t chan, int err, const char *fmt, ...)
{
	va_list ap;
	int n;
	put32(tx + HDR, (uint32_t)err);
	va_start(ap, fmt);
	n = vsnprintf((char *)tx + HDR + 4, 1024, fmt, ap);
	va_end(ap);
	if (n > 1023)
		n = 1023;
	send_frame(R_ERROR, chan, tx + HDR, 4 + (size_t)n + 1);
}

/* FRES: i32 err, then (only when err == 0) the result bytes. */
static void send_fres(uint32_t chan, int err, const void *res, size_t n)
{
	put32(tx + HDR, (uint32_t)err);
	if (err)
		n = 0;
	if (n > 0)
		memmove(tx + HDR + 4, res, n);
	send_frame(R_FRES, chan, tx + HDR, 4 + n);
}

/* ---- OOM kills ------------------------------------------------------------------------ */

/* The kernel's oom_kill counter from /proc/vmstat (0 if it cannot be read). */
static uint64_t oom_count(void)
{
	static char buf[16384];
	ssize_t n = vmstat_fd < 0 ? -1 : pread(vmstat_fd, buf, sizeof buf - 1, 0);
	char *at;

	if (n <= 0)
		return 0;
	buf[n] = 0;
	at = strstr(buf, "\noom_kill ");
	return at ? strtoull(at + 10, NULL, 10) : 0;
}

/*
 * Sends OOM (the count) when it changed since the last one sent, or always if `force`. Called
 * after a process's output was read or its exit reaped and before that is forwarded: the kernel
 * counts an OOM kill before it sends the SIGKILL, so whatever a death caused (the end of its
 * output, its status, a shell's next line) reaches the host after the new count.
 */
static void oom_report(int force)
{
	uint64_t now = oom_count();
	unsigned char b[8];

	if (!force && now == oom_sent)
		return;
	oom_sent = now;
	put64(b, now);
	send_frame(R_OOM, 0, b, 8);
}

/* ---- processes ------------------------------------------------------------------------ */

static struct proc *find_chan(uint32_t chan)
{
	for (struct proc *p = procs; p; p = p->next)
		if (p->chan == chan && !p->done)
			return p;
	return NULL;
}

static struct proc *find_pid(pid_t pid)
{
	for (struct proc *p = procs; p; p = p->next)
		if (p->pid == pid && !p->reaped)
			return p;
	return NULL;
}

static void close_stdin(struct proc *p)
{
	if (p->in >= 0)
		close(p->in);
	p->in = -1;
	free(p->q);
	p->q = NULL;
	p->qlen = p->qoff = 0;
}

/*
 * EXIT is sent only once the process was reaped AND its stdout and stderr reached EOF, so
 * every byte of output precedes it. If grandchildren keep the pipes open after the process
 * exited, EXIT waits for them too (the host kills the tree on a timeout).
 */
static void maybe_finish(struct proc *p)
{
	if (p->done || !p->reaped || p->out >= 0 || p->err >= 0)
		return;
	oom_report(0);
	send_i32(R_EXIT, p->chan, p->status);
	close_stdin(p);
	p->done = 1;
}

static void reap(void)
{
	struct signalfd_siginfo si;
	pid_t pid;
	int st;

	while (read(sig_fd, &si, sizeof si) > 0)
		; /* signals coalesce: drain them, then collect every exited child */
	while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
		struct proc *p = find_pid(pid);
		if (p) { /* else an orphan reparented to us: nothing to report */
			p->reaped = 1;
			p->status = st;
			maybe_finish(p);
		}
	}
}

static unsigned char pipe_buf[CHUNK]; /* not tx: an OOM frame may go out first */

/* Forwards one read of a stdout/stderr pipe; EOF (or an error) closes it. */
static void pump(struct proc *p, int *fd, int type)
{
	ssize_t n = read(*fd, pipe_buf, CHUNK);
	if (n > 0) {
		oom_report(0);
		send_frame(type, p->chan, pipe_buf, (size_t)n);
		return;
	}
	if (n < 0 && (errno == EAGAIN || errno == EINTR))
		return;
	close(*fd);
	*fd = -1;
	maybe_finish(p);
}

/* Writes queued STDIN bytes as far as the pipe takes them without blocking. */
static void stdin_flush(struct proc *p)
{
	while (p->qoff < p->qlen) {
		ssize_t n = write(p->in, p->q + p->qoff, p->qlen - p->qoff);
		if (n > 0) {
			p->qoff += (size_t)n;
		} else if (n == 0 || errno == EAGAIN) {
			return; /* the loop polls for POLLOUT while q is not empty */
		} else if (errno != EINTR) {
			close_stdin(p); /* EPIPE: nobody reads stdin any more; drop the rest */
			return;
		}
	}
	p->qlen = p->qoff = 0;
	if (p->close_in)
		close_stdin(p);
}

static void do_stdin(uint32_t chan, const unsigned char *data, size_t n)
{
	struct proc *p = find_chan(chan);
	if (!p || p->in < 0 || p->close_in)
		return; /* unknown/ended process, or stdin already closed: ignored */
	if (n == 0) {
		p->close_in = 1;
	} else {
		size_t live = p->qlen - p->qoff;
		unsigned char *q;
		if (p->qoff > 0)
			memmove(p->q, p->q + p->qoff, live);
		p->qoff = 0;
		p->qlen = live;
		q = realloc(p->q, live + n);
		if (!q) {
			logmsg("stdin of chan %u: out of memory, closing it", chan);
			close_stdin(p);
			return;
		}
		memcpy(q + live, data, n);
		p->q = q;
		p->qlen = live + n;
	}
	stdin_flush(p);
}

/*
 * WATCH: where a session command ends, told by what the command cannot fake (the host's
 * executor/idle.py does the same from the host's /proc for a container's shell). A bash or
 * dash driver loop waits for its next command in read(2) of its command pipe (stdin), at one
 * point of its loop: the same /proc/PID/syscall line (number, fd, buffer, count, stack and
 * instruction pointers) every time. CALIBRATE records it once, right after a no-op command;
 * CHECK tells whether the shell waits exactly there again; MARK forwards what its stdout and
 * stderr pipes hold and then the host's token on each, as if written into the pipe behind
 * everything the shell wrote, so the last end marker before the token is the shell's.
 */
static int blocked_in(pid_t pid, char *line, size_t size, int *fd)
{
	char path[64], buf[256], *f[9], *save = NULL;
	ssize_t n;
	int sfd, k = 0;

	snprintf(path, sizeof path, "/proc/%d/syscall", (int)pid);
	if ((sfd = open(path, O_RDONLY | O_CLOEXEC)) < 0)
		return 0;
	n = read(sfd, buf, sizeof buf - 1);
	close(sfd);
	if (n <= 0)
		return 0;
	buf[n] = 0;
	for (char *t = strtok_r(buf, " \n", &save); t && k < 9; t = strtok_r(NULL, " \n", &save))
		f[k++] = t;
	if (k != 9) /* "running", or "-1 SP PC": not blocked in a call */
		return 0;
	*fd = (int)strtol(f[1], NULL, 16);
	return snprintf(line, size, "%s %s %s %s %s %s", f[0], f[1], f[2], f[3], f[7], f[8]) <
	       (int)size;
}

/* Whether pid's fd is the pipe whose other end is ours. */
static int fd_is(pid_t pid, int fd, int ours)
{
	char path[64];
	struct stat a, b;

	snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)pid, fd);
	return ours >= 0 && stat(path, &a) == 0 && fstat(ours, &b) == 0 && a.st_dev == b.st_dev &&
	       a.st_ino == b.st_ino;
}

/* Whether p waits for its next command in read(2) of its stdin pipe (where: into line). */
static int waits_for_input(struct proc *p, char *line, size_t size)
{
	int fd;
	return blocked_in(p->pid, line, size, &fd) && atoi(line) == __NR_read &&
	       fd_is(p->pid, fd, p->in);
}

/* A shell known to wait that way (busybox ash polls first). */
static int watchable(struct proc *p)
{
	char path[64], exe[PATH_MAX];
	const char *base;
	ssize_t n;

	snprintf(path, sizeof path, "/proc/%d/exe", (int)p->pid);
	if ((n = readlink(path, exe, sizeof exe - 1)) < 0)
		return 0;
	exe[n] = 0;
	base = strrchr(exe, '/') ? strrchr(exe, '/') + 1 : exe;
	return !strcmp(base, "bash") || !strcmp(base, "dash");
}

/*
 * Whether a watchable shell waits for its next command with our pipes as fds 0-2. Not yet is
 * not never: right after the no-op's end markers the driver's `printf ... >&2` may still hold
 * stdout on the stderr pipe (a loaded machine preempts it there), so CALIBRATE answers NO and
 * is asked again rather than giving the shell up.
 */
static int waits_with_our_pipes(struct proc *p, char *line, size_t size)
{
	return waits_for_input(p, line, size) && fd_is(p->pid, 1, p->out) &&
	       fd_is(p->pid, 2, p->err);
}

/* Forwards what pipe *fd holds now (not what is written meanwhile), then the token. */
static int mark(struct proc *p, int *fd, int which, int type, const unsigned char *tok, size_t n)
{
	int left = 0;

	if (!fd_is(p->pid, which, *fd) || ioctl(*fd, FIONREAD, &left) < 0)
		return 0; /* its fd went elsewhere (exec >file): nothing more of it comes here */
	while (left > 0 && *fd >= 0) {
		ssize_t got = read(*fd, pipe_buf, (size_t)left < CHUNK ? (size_t)left : CHUNK);
		if (got <= 0)
			break;
		oom_report(0);
		send_frame(type, p->chan, pipe_buf, (size_t)got);
		left -= (int)got;
	}
	send_frame(type, p->chan, tok, n);
	return 1;
}

static void do_watch(uint32_t chan, const unsigned char *p, size_t n)
{
	struct proc *pr = find_chan(chan);
	unsigned char res[2] = { W_UNWATCHED, 0 };
	char line[sizeof pr->rest];

	if (n < 1 || p[0] < W_CALIBRATE || p[0] > W_MARK || (p[0] == W_MARK && n < 2)) {
		send_error(chan, EPROTO, "malformed WATCH");
		return;
	}
	if (pr && !pr->reaped && p[0] == W_CALIBRATE && watchable(pr)) {
		res[0] = waits_with_our_pipes(pr, line, sizeof line) ? W_YES : W_NO;
		if (res[0] == W_YES)
			memcpy(pr->rest, line, sizeof line);
	} else if (pr && !pr->reaped && pr->rest[0] && p[0] == W_CHECK) {
		res[0] = waits_for_input(pr, line, sizeof line) && !strcmp(line, pr->rest);
	} else if (pr && !pr->reaped && pr->rest[0] && p[0] == W_MARK) {
		res[0] = mark(pr, &pr->out, 1, R_STDOUT, p + 1, n - 1);
		res[1] = mark(pr, &pr->err, 2, R_STDERR, p + 1, n - 1);
	} else if (p[0] == W_MARK) {
		res[0] = 0; /* neither token sent */
	}
	send_frame(R_WATCHED, chan, res, p[0] == W_MARK ? 2 : 1);
}

/* What a child that could not exec reports through its status pipe. */
struct child_err {
	int err, stage;
};
enum { ST_CHROOT, ST_DOMAIN, ST_CAPS, ST_SETGROUPS, ST_SETGID, ST_SETUID, ST_CHDIR, ST_DUP,
       ST_EXEC };
static const char *const stage_name[] = { "chroot", "enter a Landlock domain",
					  "drop capabilities", "setgroups", "setgid", "setuid",
					  "chdir", "dup2", "exec" };

static __attribute__((noreturn)) void child_fail(int fd, int stage)
{
	struct child_err ce = { errno, stage };
	if (write(fd, &ce, sizeof ce) < 0)
		_exit(126);
	_exit(127);
}

/* execvpe() with the PATH of the given environment (not the agent's), glibc's error rules. */
static void exec_path(char *const argv[], char *const envp[])
{
	const char *file = argv[0], *path = DEFAULT_PATH, *end;
	size_t flen = strlen(file);
	int eacces = 0;
	char buf[PATH_MAX];

	if (!*file) {
		errno = ENOENT;
		return;
	}
	if (strchr(file, '/')) {
		execve(file, argv, envp);
		return;
	}
	for (char *const *e = envp; *e; e++)
		if (!strncmp(*e, "PATH=", 5)) {
			path = *e + 5;
			break;
		}
	for (const char *dir = path;; dir = end + 1) {
		size_t dlen;
		end = strchrnul(dir, ':');
		dlen = (size_t)(end - dir);
		if (dlen + 1 + flen + 1 <= sizeof buf) {
			memcpy(buf, dir, dlen);
			if (dlen > 0) /* an empty PATH element means the current directory */
				buf[dlen++] = '/';
			memcpy(buf + dlen, file, flen + 1);
			execve(buf, argv, envp);
			switch (errno) {
			case EACCES:
				eacces = 1;
				break;
			case ENOENT: case ENOTDIR: case ESTALE: case ENODEV: case ETIMEDOUT:
			case ELOOP: case ENAMETOOLONG:
				break;
			default:
				return; /* e.g. ENOEXEC, E2BIG: report this one */
			}
		}
		if (!*end)
			break;
	}
	errno = eacces ? EACCES : ENOENT;
}

/*
 * A Landlock domain of its own for a spawned process, shared by its descendants only. Every
 * process of a sandbox runs as the same user, so without one any of them could ptrace any
 * other, open its /proc/PID/fd/N (a session shell's pipes, a grader's command's) or write its
 * memory: a process the agent left running could rewrite what a later grader's command
 * reports. A process in a domain may trace only processes in the same domain or one nested
 * in it (that check also guards /proc's fd, mem and environ, and process_vm_*). The domain
 * restricts nothing else: it handles only LANDLOCK_ACCESS_FS_REFER (cross-directory renames
 * and links, which any domain denies unless granted) and grants that beneath the root. The
 * same as a container's dsec-enter --own-domain; ABI >= 2 (Linux 5.19) has REFER.
 */
/* struct landlock_ruleset_attr as of ABI 6 (Linux 6.12), which the build's headers may lack;
 * an older kernel takes it while the fields it does not know are zero. */
struct ruleset_attr_v6 {
	__u64 handled_access_fs;
	__u64 handled_access_net;
	__u64 scoped;
};

/* From ABI 6 the domain also scopes signals (LANDLOCK_SCOPE_SIGNAL), as dsec-enter's does: a
 * process left running cannot signal what a later caller runs. (The kit takes bookworm-backports'
 * 6.12 where apt has it; bookworm's own 6.1 has ABI 2: there it scopes ptrace only.) */
static int own_domain(void)
{
	struct ruleset_attr_v6 attr = { .handled_access_fs = LANDLOCK_ACCESS_FS_REFER,
					.scoped = landlock_abi >= 6 ? 1ULL << 1 : 0 };
	struct landlock_path_beneath_attr beneath = { .allowed_access = LANDLOCK_ACCESS_FS_REFER };
	int ruleset = (int)syscall(__NR_landlock_create_ruleset, &attr, sizeof attr, 0);

	if (ruleset < 0)
		return -1;
	beneath.parent_fd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (beneath.parent_fd < 0 ||
	    syscall(__NR_landlock_add_rule, ruleset, LANDLOCK_RULE_PATH_BENEATH, &beneath, 0) < 0 ||
	    syscall(__NR_landlock_restrict_self, ruleset, 0) < 0)
		return -1; /* (the child's fds are closed before it execs) */
	close(beneath.parent_fd);
	close(ruleset);
	return 0;
}

/*
 * The capabilities no process the agent starts keeps (dropped from its bounding set, so not
 * even a setuid-root program gets them back): each lets guest root change the guest kernel,
 * and through it the agent that reports every result to the host. Loading code (modules;
 * kexec, which also needs the sysctl init turns off), raw memory and I/O ports (/dev/mem over
 * the virtio devices' MMIO, iopl), and BPF/perf programs (a kprobe running
 * bpf_probe_write_user in the agent's context); CAP_SYS_ADMIN grants the last too, with swapon,
 * /dev/snapshot and more. Mount, which it also grants, the Landlock domain denies already.
 * Everything else a root user expects (chown, ptrace of its own processes, network
 * configuration, nice, chroot) stays. The guest's /init makes the kernel's own knobs
 * read-only (docs/decisions.md: "A microVM's guest root cannot reach its agent").
 */
static const int dropped_caps[] = { CAP_SYS_MODULE, CAP_SYS_RAWIO, CAP_SYS_ADMIN, CAP_SYS_BOOT,
				    CAP_PERFMON, CAP_BPF };

static int drop_caps(void)
{
	for (size_t i = 0; i < sizeof dropped_caps / sizeof *dropped_caps; i++)
		if (prctl(PR_CAPBSET_DROP, dropped_caps[i], 0, 0, 0) < 0 && errno != EINVAL)
			return -1; /* (EINVAL: a kernel that does not know this capability) */
	return 0;
}

/* The forked child: never returns. On failure it reports errno through fd st (CLOEXEC, so a
 * successful exec closes it and the parent reads EOF). */
static __attribute__((noreturn)) void child(int in, int out, int err, int st, const char *cwd,
					     uid_t uid, gid_t gid, char *const argv[],
					     char *const envp[])
{
	sigset_t none;

	/* The agent blocks SIGCHLD and ignores SIGPIPE; both would survive exec. */
	for (int s = 1; s < NSIG; s++)
		signal(s, SIG_DFL);
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	setrlimit(RLIMIT_NOFILE, &nofile);
	setsid(); /* own session and process group: KILL can signal the whole group */
	umask(022); /* the agent runs with umask 0 so FOP modes are exact */

	if (chroot(root_path) < 0 || chdir("/") < 0)
		child_fail(st, ST_CHROOT);
	if (landlock_abi >= 2 && own_domain() < 0) /* while root: no no_new_privs needed */
		child_fail(st, ST_DOMAIN);
	/* Root's permitted and effective sets after exec are its bounding set: dropped there. */
	if (drop_caps() < 0)
		child_fail(st, ST_CAPS);
	if (setgroups(0, NULL) < 0)
		child_fail(st, ST_SETGROUPS);
	if (setgid(gid) < 0)
		child_fail(st, ST_SETGID);
	if (setuid(uid) < 0)
		child_fail(st, ST_SETUID);
	if (chdir(cwd) < 0) /* after setuid: the user must be allowed to enter it */
		child_fail(st, ST_CHDIR);
	/* The agent keeps fds 0-2 open, so the pipe fds are all >= 3 and cannot be clobbered. */
	if (dup2(in, 0) < 0 || dup2(out, 1) < 0 || dup2(err, 2) < 0)
		child_fail(st, ST_DUP);
	/*
	 * Close everything else. The agent opens its fds CLOEXEC, but this must hold even if one
	 * slipped through: another process's pipe end leaking into this one would hold that
	 * process's stdout open (delaying its EXIT forever), and the port must never be reachable
	 * from the sandbox. Only the status pipe stays (it is CLOEXEC).
	 */
	if ((st > 3 && close_range(3, (unsigned)st - 1, 0) < 0) ||
	    close_range((unsigned)st + 1, ~0U, 0) < 0) {
		long max = sysconf(_SC_OPEN_MAX);
		for (int fd = 3; fd < (max > 0 ? max : 65536); fd++)
			if (fd != st)
				close(fd);
	}
	exec_path(argv, envp);
	child_fail(st, ST_EXEC);
}

/* Returns the next NUL-terminated string of a payload, or NULL if there is none. */
static const char *next_str(const unsigned char **p, size_t *n)
{
	const unsigned char *z = memchr(*p, 0, *n);
	const char *s = (const char *)*p;
	if (!z)
		return NULL;
	*n -= (size_t)(z + 1 - *p);
	*p = z + 1;
	return s;
}

static void do_spawn(uint32_t chan, const unsigned char *p, size_t n)
{
	uint32_t uid, gid, argc, envc;
	const char *cwd, **argv = NULL, **envp = NULL;
	int in[2] = { -1, -1 }, out[2] = { -1, -1 }, err[2] = { -1, -1 }, st[2] = { -1, -1 };
	struct child_err ce;
	struct proc *pr;
	ssize_t got;
	pid_t pid;

	if (n < 16)
		goto malformed;
	uid = get32(p); gid = get32(p + 4); argc = get32(p + 8); envc = get32(p + 12);
	p += 16;
	n -= 16;
	/* Every string takes at least one byte: bounds the allocations below. */
	if (argc < 1 || argc > n || envc > n)
		goto malformed;
	argv = calloc(argc + 1, sizeof *argv);
	envp = calloc(envc + 1, sizeof *envp);
	if (!argv || !envp) {
		send_error(chan, ENOMEM, "out of memory");
		goto out;
	}
	if (!(cwd = next_str(&p, &n)))
		goto malformed;
	for (uint32_t i = 0; i < argc; i++)
		if (!(argv[i] = next_str(&p, &n)))
			goto malformed;
	for (uint32_t i = 0; i < envc; i++)
		if (!(envp[i] = next_str(&p, &n)))
			goto malformed;
	if (n != 0)
		goto malformed;
	if (chan == 0 || find_chan(chan)) {
		send_error(chan, EBUSY, "chan %u is 0 or already in use", chan);
		goto out;
	}

	if (pipe2(in, O_CLOEXEC) < 0 || pipe2(out, O_CLOEXEC) < 0 || pipe2(err, O_CLOEXEC) < 0 ||
	    pipe2(st, O_CLOEXEC) < 0) {
		send_error(chan, errno, "pipe: %s", strerror(errno));
		goto close_all;
	}
	pid = fork();
	if (pid < 0) {
		send_error(chan, errno, "fork: %s", strerror(errno));
		goto close_all;
	}
	if (pid == 0)
		child(in[0], out[1], err[1], st[1], cwd, uid, gid, (char *const *)argv,
		      (char *const *)envp);
	close(in[0]); close(out[1]); close(err[1]); close(st[1]);
	in[0] = out[1] = err[1] = st[1] = -1;

	/* Blocks until the child execs (EOF) or fails (its report); that is immediate. */
	do
		got = read(st[0], &ce, sizeof ce);
	while (got < 0 && errno == EINTR);
	if (got == (ssize_t)sizeof ce) {
		const char *what = ce.stage == ST_EXEC ? argv[0] : ce.stage == ST_CHDIR ? cwd : NULL;
		const char *stage = ce.stage >= 0 && ce.stage <= ST_EXEC ? stage_name[ce.stage] : "?";
		if (what)
			send_error(chan, ce.err, "%s %s: %s", stage, what, strerror(ce.err));
		else
			send_error(chan, ce.err, "%s: %s", stage, strerror(ce.err));
		waitpid(pid, NULL, 0);
		goto close_all;
	}
	pr = calloc(1, sizeof *pr);
	if (!pr) { /* cannot track it: kill it rather than leave an invisible process */
		kill(pid, SIGKILL);
		waitpid(pid, NULL, 0);
		send_error(chan, ENOMEM, "out of memory");
		goto close_all;
	}
	fcntl(in[1], F_SETFL, O_NONBLOCK);
	fcntl(out[0], F_SETFL, O_NONBLOCK);
	fcntl(err[0], F_SETFL, O_NONBLOCK);
	*pr = (struct proc){ .next = procs, .chan = chan, .pid = pid,
			     .in = in[1], .out = out[0], .err = err[0] };
	procs = pr;
	close(st[0]);
	send_i32(R_STARTED, chan, pid);
	goto out;

malformed:
	send_error(chan, EPROTO, "malformed SPAWN");
	goto out;
close_all:
	for (int i = 0; i < 2; i++) {
		if (in[i] >= 0) close(in[i]);
		if (out[i] >= 0) close(out[i]);
		if (err[i] >= 0) close(err[i]);
		if (st[i] >= 0) close(st[i]);
	}
out:
	free(argv);
	free(envp);
}

/*
 * Signals a process tree: its process group (which outlives the leader while members remain,
 * and whose number cannot be reused meanwhile), every process of its session, and every
 * descendant of those found through /proc/<pid>/stat parent links, which catches children
 * that moved to another group or session. The snapshot is taken BEFORE anything is signalled:
 * a dying parent's children are reparented to us at once, which would cut the links.
 * Orphans of an already dead parent that also left the session are out of reach.
 */
static void kill_tree(pid_t root, int alive, int sig)
{
	struct ent { pid_t pid, ppid, pgid, sid; int mark; } *t = NULL;
	size_t n = 0, cap = 0;
	struct dirent *de;
	DIR *d;
	int changed;

	d = opendir("/proc");
	while (d && (de = readdir(d))) {
		char path[64], buf[512], *s;
		struct ent e = { 0 };
		ssize_t len;
		int fd;

		if ((e.pid = atoi(de->d_name)) <= 1)
			continue;
		snprintf(path, sizeof path, "/proc/%d/stat", e.pid);
		if ((fd = open(path, O_RDONLY | O_CLOEXEC)) < 0)
			continue;
		len = read(fd, buf, sizeof buf - 1);
		close(fd);
		if (len <= 0)
			continue;
		buf[len] = 0;
		/* "pid (comm) state ppid pgrp session ...": comm may contain anything, even ')' */
		if (!(s = strrchr(buf, ')')) ||
		    sscanf(s + 1, " %*c %d %d %d", &e.ppid, &e.pgid, &e.sid) != 3)
			continue;
		e.mark = (e.pid == root && alive) || e.pgid == root || e.sid == root;
		if (n == cap) {
			void *nt = realloc(t, (cap = cap ? 2 * cap : 256) * sizeof *t);
			if (!nt)
				break;
			t = nt;
		}
		t[n++] = e;
	}
	if (d)
		closedir(d);
	do { /* add the children of marked processes until nothing changes */
		changed = 0;
		for (size_t i = 0; i < n; i++)
			for (size_t j = 0; j < n && !t[i].mark; j++)
				if (t[j].mark && t[i].ppid == t[j].pid)
					t[i].mark = changed = 1;
	} while (changed);
	kill(-root, sig); /* (also gets children forked into the group since the scan) */
	for (size_t i = 0; i < n; i++)
		if (t[i].mark && t[i].pid != getpid())
			kill(t[i].pid, sig);
	free(t);
}

static void do_kill(uint32_t chan, const unsigned char *p, size_t n)
{
	struct proc *pr = find_chan(chan);
	int sig;

	if (n != 8) {
		send_error(chan, EPROTO, "malformed KILL");
		return;
	}
	if (!pr)
		return;
	sig = (int32_t)get32(p);
	if (!(get32(p + 4) & 1)) {
		if (!pr->reaped) /* once reaped, the pid may belong to someone else */
			kill(pr->pid, sig);
	} else if (!(pr->reaped && find_pid(pr->pid))) {
		/* (if reaped and its pid already names a newer process, its group/session are gone) */
		kill_tree(pr->pid, !pr->reaped, sig);
	}
}

/* ---- file operations ------------------------------------------------------------------ */

/*
 * Kernel file systems (<linux/magic.h>): views of the kernel, not the sandbox's files. The
 * file operations serve none of them (the host's executor/_openat2.py KERNEL_FS_MAGIC): as
 * the agent, they would show its own /proc files and what the sandbox's user may not see.
 */
static const unsigned long kernel_fs[] = {
	0x9fa0,	    0x62656572, 0x64626720, 0x74726163, 0x73636673, 0x27e0eb,	0x63677270,
	0xcafe4a11, 0x62656570, 0xde5e81e4, 0x6165676c, 0xf97cff8c, 0x1cd1,	0x42494e4d,
	0x19800202, 0x6e736673, 0x65735543, 0x6c6f6f70,
};

static int on_kernel_fs(int fd)
{
	struct statfs sfs;

	if (fstatfs(fd, &sfs) < 0)
		return 1; /* unknown: refused */
	for (size_t i = 0; i < sizeof kernel_fs / sizeof kernel_fs[0]; i++)
		if (((unsigned long)sfs.f_type & 0xffffffffUL) == kernel_fs[i])
			return 1;
	return 0;
}

/* openat2() below the sandbox root: ".." and symlinks (even absolute ones) stay inside it.
 * A result on a kernel file system is refused with EMEDIUMTYPE (the host's "kernel_fs"). */
static int resolve(const char *path, int flags)
{
	struct open_how how = { .flags = (uint64_t)(flags | O_CLOEXEC),
				.resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS };
	for (int i = 0; i < 16; i++) {
		int fd = (int)syscall(SYS_openat2, root_fd, path, &how, sizeof how);
		if (fd >= 0 && on_kernel_fs(fd)) {
			close(fd);
			errno = EMEDIUMTYPE;
			return -1;
		}
		if (fd >= 0 || errno != EAGAIN) /* EAGAIN: a concurrent rename/mount; retry */
			return fd;
	}
	return -1;
}

static int is_root(const char *path)
{
	return path[strspn(path, "/")] == 0;
}

static int is_dots(const char *name)
{
	return !strcmp(name, ".") || !strcmp(name, "..");
}

/*
 * Opens (O_PATH) the parent directory of a non-root path and copies its last component to
 * name; the caller then works on name with *at() calls that do not follow a final symlink.
 * Returns the fd, or -1 with errno set.
 */
static int open_parent(const char *path, char name[NAME_MAX + 1])
{
	size_t end = strlen(path), start;
	char *parent;
	int fd, e;

	while (end > 1 && path[end - 1] == '/')
		end--;
	for (start = end; start > 0 && path[start - 1] != '/'; start--)
		;
	if (end - start > NAME_MAX) {
		errno = ENAMETOOLONG;
		return -1;
	}
	memcpy(name, path + start, end - start);
	name[end - start] = 0;
	if (!(parent = strndup(path, start)))
		return -1;
	fd = resolve(parent, O_PATH | O_DIRECTORY);
	e = errno;
	free(parent);
	errno = e;
	return fd;
}

static void put_stat(unsigned char *p, const struct stat *st)
{
	put32(p, st->st_mode);
	put32(p + 4, st->st_uid);
	put32(p + 8, st->st_gid);
	put64(p + 12, (uint64_t)st->st_size);
	put64(p + 20, (uint64_t)((int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec));
}

static void op_stat(uint32_t chan, const char *path)
{
	unsigned char rec[28];
	struct stat st;
	/* O_PATH|O_NOFOLLOW opens a final symlink itself: fstat() is then an lstat(). */
	int fd = resolve(path, O_PATH | O_NOFOLLOW), err = 0;

	if (fd < 0 || fstat(fd, &st) < 0)
		err = errno;
	if (fd >= 0)
		close(fd);
	if (!err)
		put_stat(rec, &st);
	send_fres(chan, err, rec, sizeof rec);
}

static void op_list(uint32_t chan, const char *path)
{
	/* A final symlink to a directory is followed (inside the root), like `ls path`. */
	int fd = resolve(path, O_RDONLY | O_DIRECTORY), err = 0;
	unsigned char *buf = NULL;
	size_t len = 4, cap = 0;
	uint32_t count = 0;
	struct dirent *de;
	DIR *d;

	if (fd < 0 || !(d = fdopendir(fd))) {
		err = errno;
		if (fd >= 0)
			close(fd);
		send_fres(chan, err, NULL, 0);
		return;
	}
	while ((de = readdir(d))) {
		size_t nl = strlen(de->d_name) + 1;
		struct stat st;
		if (is_dots(de->d_name) || fstatat(fd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0)
			continue; /* (an entry removed since readdir() is simply skipped) */
		if (len + nl + 28 > MAX_PAYLOAD - 4) {
			err = EOVERFLOW; /* the result would not fit in one FRES frame */
			break;
		}
		if (len + nl + 28 > cap) {
			unsigned char *nb = realloc(buf, cap = 2 * (len + nl + 28) + 4096);
			if (!nb) {
				err = ENOMEM;
				break;
			}
			buf = nb;
		}
		memcpy(buf + len, de->d_name, nl);
		put_stat(buf + len + nl, &st);
		len += nl + 28;
		count++;
	}
	closedir(d);
	if (!err) {
		if (!buf && !(buf = malloc(4)))
			err = ENOMEM;
		else
			put32(buf, count);
	}
	send_fres(chan, err, buf, len);
	free(buf);
}

static int mkdir_one(const char *path, mode_t mode)
{
	char name[NAME_MAX + 1];
	int dfd = open_parent(path, name), err = 0;
	if (dfd < 0)
		return errno;
	if (mkdirat(dfd, name, mode) < 0)
		err = errno;
	close(dfd);
	return err;
}

static int op_mkdir(const char *path, mode_t mode, int parents)
{
	char *buf;
	int err = 0, fd;

	if (is_root(path))
		return parents ? 0 : EEXIST;
	if (!parents)
		return mkdir_one(path, mode);
	/* mkdir -p: each prefix in turn (each resolved from the root again, so a symlinked
	 * component is followed inside the root); EEXIST is fine on the way. */
	if (!(buf = strdup(path)))
		return ENOMEM;
	for (char *s = buf + 1; !err; s++) {
		if ((*s == '/' || !*s) && s[-1] != '/') {
			char c = *s;
			*s = 0;
			err = mkdir_one(buf, mode);
			if (err == EEXIST)
				err = 0;
			*s = c;
		}
		if (!*s)
			break;
	}
	free(buf);
	if (err)
		return err;
	/* The path exists now: it must be a directory (or a symlink to one). */
	if ((fd = resolve(path, O_PATH | O_DIRECTORY)) < 0)
		return errno == ENOTDIR ? EEXIST : errno;
	close(fd);
	return 0;
}

/*
 * rm -r of dfd/name without following symlinks: directories are opened O_NOFOLLOW relative to
 * their already-open parent, so a concurrent swap for a symlink cannot redirect it. Does not
 * descend into other filesystems (mount points such as /proc or /dev: EBUSY). Keeps going
 * after an error and returns the first one.
 */
static int rm_tree(int dfd, const char *name, dev_t dev)
{
	struct dirent *de;
	struct stat st;
	int fd, err = 0;
	DIR *d;

	if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0)
		return errno;
	if (!S_ISDIR(st.st_mode))
		return unlinkat(dfd, name, 0) < 0 ? errno : 0;
	if (st.st_dev != dev) {
		/* A mount point: not entered; a kernel one says so, as resolve() does. */
		fd = openat(dfd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
		err = fd >= 0 && on_kernel_fs(fd) ? EMEDIUMTYPE : EBUSY;
		if (fd >= 0)
			close(fd);
		return err;
	}
	if ((fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)) < 0)
		return errno;
	if (!(d = fdopendir(fd))) {
		err = errno;
		close(fd);
		return err;
	}
	while ((de = readdir(d))) {
		int e;
		if (is_dots(de->d_name))
			continue;
		e = rm_tree(fd, de->d_name, dev);
		if (e && !err)
			err = e;
	}
	closedir(d);
	if (unlinkat(dfd, name, AT_REMOVEDIR) < 0 && !err)
		err = errno;
	return err;
}

static int op_remove(const char *path, int recursive)
{
	char name[NAME_MAX + 1];
	struct stat st, dst;
	int dfd, err = 0;

	if (is_root(path))
		return EBUSY;
	if ((dfd = open_parent(path, name)) < 0)
		return errno;
	if (is_dots(name)) /* would act on the parent itself (or escape via "..") */
		err = EINVAL;
	else if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0 || fstat(dfd, &dst) < 0)
		err = errno;
	else if (!S_ISDIR(st.st_mode))
		err = unlinkat(dfd, name, 0) < 0 ? errno : 0;
	else if (recursive)
		err = rm_tree(dfd, name, dst.st_dev);
	else
		err = unlinkat(dfd, name, AT_REMOVEDIR) < 0 ? errno : 0; /* ENOTEMPTY unless empty */
	close(dfd);
	return err;
}

/* rename(2) of one path to another, both parents resolved inside the root; neither final
 * component is followed (a symlink is moved itself). */
static int op_rename(const char *from, const char *to)
{
	char a[NAME_MAX + 1], b[NAME_MAX + 1];
	int sfd, dfd, err = 0;

	if (is_root(from) || is_root(to))
		return EBUSY;
	if ((sfd = open_parent(from, a)) < 0)
		return errno;
	if ((dfd = open_parent(to, b)) < 0) {
		err = errno;
		close(sfd);
		return err;
	}
	if (is_dots(a) || is_dots(b))
		err = EINVAL;
	else if (renameat(sfd, a, dfd, b) < 0)
		err = errno;
	close(sfd);
	close(dfd);
	return err;
}

static void op_read(uint32_t chan, const char *path)
{
	/* O_NONBLOCK: opening a FIFO must not hang the agent (it is rejected just below). */
	int fd = resolve(path, O_RDONLY | O_NONBLOCK | O_NOCTTY), err = 0;
	struct stat st;
	struct rd *r = NULL;

	if (fd < 0 || fstat(fd, &st) < 0)
		err = errno;
	else if (S_ISDIR(st.st_mode))
		err = EISDIR;
	else if (!S_ISREG(st.st_mode))
		err = EINVAL;
	else if (!(r = malloc(sizeof *r)))
		err = ENOMEM;
	if (err) {
		if (fd >= 0)
			close(fd);
		send_fres(chan, err, NULL, 0);
		return;
	}
	*r = (struct rd){ .next = reads, .chan = chan, .fd = fd };
	reads = r;
	send_fres(chan, 0, NULL, 0);
}

/* Sends the next chunk of every READ in progress. */
static void step_reads(void)
{
	for (struct rd **pp = &reads, *r; (r = *pp);) {
		ssize_t n = read(r->fd, tx + HDR, CHUNK);
		if (n < 0 && errno == EINTR)
			continue;
		if (n > 0) {
			send_frame(R_DATA, r->chan, tx + HDR, (size_t)n);
			pp = &r->next;
			continue;
		}
		if (n == 0) /* the empty DATA that ends a READ */
			send_frame(R_DATA, r->chan, NULL, 0);
		else /* FRES(0) is already out: report the failure instead of ending the data */
			send_error(r->chan, errno, "read: %s", strerror(errno));
		close(r->fd);
		*pp = r->next;
		free(r);
	}
}

static struct wr **find_wr(uint32_t chan)
{
	struct wr **pp = &writes;
	while (*pp && (*pp)->chan != chan)
		pp = &(*pp)->next;
	return pp;
}

/* Ends a WRITE: the temp file is renamed over the target (commit) or removed. */
static int end_write(struct wr **pp, int commit)
{
	struct wr *w = *pp;
	int err = w->err;

	if (commit && !err && fsync(w->fd) < 0)
		err = errno;
	if (commit && !err && renameat(w->dir, w->tmp, w->dir, w->name) < 0)
		err = errno;
	if (!commit || err)
		unlinkat(w->dir, w->tmp, 0);
	close(w->fd);
	close(w->dir);
	*pp = w->next;
	free(w);
	return commit ? err : 0;
}

static int op_write(uint32_t chan, const char *path, mode_t mode, uid_t uid, gid_t gid)
{
	static unsigned seq;
	struct wr **pp = find_wr(chan), *w;
	struct stat st;
	int dfd, fd = -1, err;

	if (*pp) /* a new WRITE on a chan whose previous one never ended: drop that one */
		end_write(pp, 0);
	if (is_root(path))
		return EISDIR;
	if (!(w = calloc(1, sizeof *w)))
		return ENOMEM;
	if ((dfd = open_parent(path, w->name)) < 0) {
		err = errno;
		goto fail;
	}
	if (is_dots(w->name) || (fstatat(dfd, w->name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
				 S_ISDIR(st.st_mode))) {
		err = EISDIR;
		goto fail;
	}
	for (int i = 0; i < 100 && fd < 0; i++) {
		struct timespec ts;
		clock_gettime(CLOCK_MONOTONIC, &ts);
		seq = seq * 1103515245u + 12345u + (unsigned)ts.tv_nsec;
		/* (the name is cut so that the temp name stays within NAME_MAX) */
		snprintf(w->tmp, sizeof w->tmp, ".%.200s.dsec-%06x", w->name, (seq >> 8) & 0xffffff);
		fd = openat(dfd, w->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
		if (fd < 0 && errno != EEXIST)
			break;
	}
	/* chown before chmod: chown by root clears the set-user/group-ID bits of the mode. */
	if (fd < 0 || fchown(fd, uid, gid) < 0 || fchmod(fd, mode & 07777) < 0) {
		err = errno;
		if (fd >= 0) {
			unlinkat(dfd, w->tmp, 0);
			close(fd);
		}
		goto fail;
	}
	w->next = writes;
	w->chan = chan;
	w->dir = dfd;
	w->fd = fd;
	writes = w;
	return 0;
fail:
	if (dfd >= 0)
		close(dfd);
	free(w);
	return err;
}

static void do_data(uint32_t chan, const unsigned char *p, size_t n)
{
	struct wr *w = *find_wr(chan);
	if (!w) /* no WRITE in progress (it failed to start, or it is an unknown chan) */
		return;
	while (n > 0 && !w->err) {
		ssize_t k = write(w->fd, p, n);
		if (k > 0) {
			p += k;
			n -= (size_t)k;
		} else if (k == 0 || errno != EINTR) {
			w->err = k == 0 ? ENOSPC : errno; /* reported by the COMMIT's FRES */
		}
	}
}

static void do_fop(uint32_t chan, const unsigned char *p, size_t n)
{
	size_t fixed;
	const char *path;
	int op;

	if (n < 1)
		goto malformed;
	op = p[0];
	p++;
	n--;
	if (op == OP_RENAME) {
		/* Two paths, each NUL-terminated, the second ending exactly at the payload's end. */
		const char *end = memchr(p, 0, n);
		size_t first = end ? (size_t)(end - (const char *)p) + 1 : n;
		if (!end || first >= n || memchr(p + first, 0, n - first) != p + n - 1)
			goto malformed;
		if (p[0] != '/' || p[first] != '/') {
			send_fres(chan, EINVAL, NULL, 0);
			return;
		}
		send_fres(chan, op_rename((const char *)p, (const char *)p + first), NULL, 0);
		return;
	}
	switch (op) {
	case OP_MKDIR: fixed = 5; break;
	case OP_REMOVE: fixed = 1; break;
	case OP_WRITE: fixed = 12; break;
	case OP_STAT: case OP_LIST: case OP_READ: fixed = 0; break;
	default:
		send_fres(chan, EOPNOTSUPP, NULL, 0);
		return;
	}
	/* The path is the last field and must end exactly at the end of the payload. */
	if (n <= fixed || memchr(p + fixed, 0, n - fixed) != p + n - 1)
		goto malformed;
	path = (const char *)p + fixed;
	if (path[0] != '/') {
		send_fres(chan, EINVAL, NULL, 0);
		return;
	}
	switch (op) {
	case OP_STAT: op_stat(chan, path); break;
	case OP_LIST: op_list(chan, path); break;
	case OP_READ: op_read(chan, path); break;
	case OP_MKDIR: send_fres(chan, op_mkdir(path, get32(p) & 07777, p[4]), NULL, 0); break;
	case OP_REMOVE: send_fres(chan, op_remove(path, p[0]), NULL, 0); break;
	case OP_WRITE:
		send_fres(chan, op_write(chan, path, get32(p), get32(p + 4), get32(p + 8)), NULL, 0);
		break;
	}
	return;
malformed:
	send_error(chan, EPROTO, "malformed FOP");
}

/* ---- port input ----------------------------------------------------------------------- */

static void handle_frame(int type, uint32_t chan, const unsigned char *p, size_t n)
{
	unsigned char pong[256];
	struct wr **pp;

	switch (type) {
	case T_SPAWN: do_spawn(chan, p, n); break;
	case T_STDIN: do_stdin(chan, p, n); break;
	case T_KILL: do_kill(chan, p, n); break;
	case T_FOP: do_fop(chan, p, n); break;
	case T_WATCH: do_watch(chan, p, n); break;
	case T_DATA: do_data(chan, p, n); break;
	case T_COMMIT:
	case T_ABORT:
		pp = find_wr(chan);
		send_fres(chan, *pp ? end_write(pp, type == T_COMMIT) : EBADF, NULL, 0);
		break;
	case T_PING:
		/* A new edge (it restarted) asks to forget what the old one started: the old
		 * sessions' shells get EOF on stdin and end, as a container's do when their edge
		 * goes; what they started in the background keeps running. A resume after a pause
		 * pings without it: its sessions carry on. */
		if (n >= 7 && memcmp(p, "forget:", 7) == 0)
			for (struct proc *q = procs; q; q = q->next)
				close_stdin(q);
		/* The payload echoed, then NUL and the version: a host that reconnects learns it
		 * too (a longer payload is only echoed). */
		if (n <= sizeof pong - 1 - sizeof VERSION) {
			memcpy(pong, p, n);
			pong[n] = 0;
			memcpy(pong + n + 1, VERSION, sizeof VERSION);
			send_frame(R_PONG, chan, pong, n + 1 + sizeof VERSION);
		} else {
			send_frame(R_PONG, chan, p, n);
		}
		oom_report(1); /* a (re)connected host starts from the current count */
		break;
	default: send_error(chan, EPROTO, "unknown frame type 0x%02x", type);
	}
}

/* Reads what the port has and handles every complete frame. Returns 0 if the host is gone. */
static int port_input(void)
{
	ssize_t got = read(port_fd, rx + rx_len, sizeof rx - rx_len);
	size_t off = 0;
	unsigned gen = conn_gen;

	if (got < 0)
		return errno == EINTR || errno == EAGAIN;
	if (got == 0) {
		/* The host closed its end. A new connection starts on a frame boundary, so a
		 * partial frame from this one must not be glued to it. */
		rx_len = 0;
		return 0;
	}
	rx_len += (size_t)got;
	while (rx_len - off >= 4) {
		uint32_t len = get32(rx + off);
		if (len < 5 || len > MAX_PAYLOAD + 5) {
			/* Frame boundaries are lost and cannot be found again (frames carry no
			 * marker): drop everything buffered and hope the host notices the ERROR. */
			logmsg("bad frame length %u, input dropped", len);
			send_error(0, EPROTO, "bad frame length %u; buffered input dropped", len);
			rx_len = off = 0;
			break;
		}
		if (rx_len - off < 4 + (size_t)len)
			break; /* partial frame: wait for the rest */
		handle_frame(rx[off + 4], get32(rx + off + 5), rx + off + HDR, len - 5);
		if (gen != conn_gen)
			return 1; /* an answer found the host gone (vsock): rx belongs to no one now */
		off += 4 + (size_t)len;
	}
	memmove(rx, rx + off, rx_len - off);
	rx_len -= off;
	return 1;
}

/* ---- main loop ------------------------------------------------------------------------ */

enum { K_SIG, K_PORT, K_OUT, K_ERR, K_IN };

int main(int argc, char **argv)
{
	struct pollfd *pfd = NULL;
	struct { struct proc *p; int kind; } *slot = NULL;
	size_t cap = 0;
	int port_gone = 0;
	sigset_t chld;

	if (argc != 3) {
		errno = EINVAL;
		fatal("usage: agent PORT ROOT");
	}
	/* Keep fds 0-2 taken (by whatever /init gave us, else /dev/null) so no pipe lands there. */
	while (fcntl(2, F_GETFD) < 0 && open("/dev/null", O_RDWR) >= 0)
		;
	umask(0); /* FOP modes are applied exactly; children get 022 back */
	/* Not dumpable: tracing us, or opening our /proc/1/{mem,fd,environ}, takes CAP_SYS_PTRACE,
	 * which a kernel helper that runs as root outside the sandbox's Landlock domains (init
	 * leaves them no capabilities) does not have. Children are dumpable again after exec. */
	prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
	/* Each process takes 3 fds: the kernel's default 1024 for init would cap us near 300. */
	getrlimit(RLIMIT_NOFILE, &nofile);
	setrlimit(RLIMIT_NOFILE, &(struct rlimit){ 65536, 65536 });
	signal(SIGPIPE, SIG_IGN); /* a closed stdin pipe gives EPIPE, not death */
	sigemptyset(&chld);
	sigaddset(&chld, SIGCHLD);
	sigprocmask(SIG_BLOCK, &chld, NULL);
	if ((sig_fd = signalfd(-1, &chld, SFD_NONBLOCK | SFD_CLOEXEC)) < 0)
		fatal("signalfd");
	root_path = argv[2];
	if ((root_fd = open(root_path, O_PATH | O_DIRECTORY | O_CLOEXEC)) < 0)
		fatal(root_path);
	vmstat_fd = open("/proc/vmstat", O_RDONLY | O_CLOEXEC);
	landlock_abi = (int)syscall(__NR_landlock_create_ruleset, NULL, 0,
				    LANDLOCK_CREATE_RULESET_VERSION);
	if (landlock_abi < 0)
		landlock_abi = 0;
	if (strncmp(argv[1], "unix:", 5) == 0) {
		/* The vsock mode's connection handling on a unix socket: how the tests run it on
		 * a host without vhost-vsock (in a PID namespace of its own, so fatal()'s power
		 * off only ends that namespace). */
		struct sockaddr_un addr = { .sun_family = AF_UNIX };
		if (strlen(argv[1] + 5) >= sizeof addr.sun_path) {
			errno = ENAMETOOLONG;
			fatal(argv[1]);
		}
		strcpy(addr.sun_path, argv[1] + 5);
		if ((listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)) < 0)
			fatal("socket(AF_UNIX)");
		if (bind(listen_fd, (struct sockaddr *)&addr, sizeof addr) < 0)
			fatal(argv[1]);
		if (listen(listen_fd, 4) < 0)
			fatal("listen");
	} else if (strncmp(argv[1], "vsock:", 6) == 0) {
		/* The host connects to us (vhost-vsock); READY greets each connection. */
		struct sockaddr_vm addr = { .svm_family = AF_VSOCK, .svm_cid = VMADDR_CID_ANY };
		char *end;
		unsigned long port = strtoul(argv[1] + 6, &end, 10);
		if (*end || port == 0 || port > 0xffffffffUL) {
			errno = EINVAL;
			fatal(argv[1]);
		}
		addr.svm_port = (unsigned)port;
		if ((listen_fd = socket(AF_VSOCK, SOCK_STREAM | SOCK_CLOEXEC, 0)) < 0)
			fatal("socket(AF_VSOCK)");
		if (bind(listen_fd, (struct sockaddr *)&addr, sizeof addr) < 0)
			fatal(argv[1]);
		if (listen(listen_fd, 4) < 0)
			fatal("listen");
	} else {
		if ((port_fd = open(argv[1], O_RDWR | O_NOCTTY | O_CLOEXEC)) < 0)
			fatal(argv[1]);
		/* Blocks until the host connects: a virtio-serial port holds writes until then. */
		send_frame(R_READY, 0, VERSION, sizeof VERSION);
		oom_report(1);
	}

	for (;;) {
		size_t n = 0, need = 2;
		int port_slot = -1, timeout = -1;
		unsigned gen = conn_gen;

		for (struct proc *p = procs; p; p = p->next)
			need += 3;
		if (need > cap) {
			cap = 2 * need;
			pfd = realloc(pfd, cap * sizeof *pfd);
			slot = realloc(slot, cap * sizeof *slot);
			if (!pfd || !slot)
				fatal("realloc");
		}
#define ADD(fd_, ev, p_, kind_) \
	(pfd[n] = (struct pollfd){ .fd = (fd_), .events = (ev) }, \
	 slot[n].p = (p_), slot[n].kind = (kind_), n++)
		ADD(sig_fd, POLLIN, NULL, K_SIG);
		if (listen_fd >= 0) {
			/* vsock: the connection's input, or a host connecting. */
			port_slot = (int)n;
			ADD(port_fd >= 0 ? port_fd : listen_fd, POLLIN, NULL, K_PORT);
		} else if (!port_gone) {
			port_slot = (int)n;
			ADD(port_fd, POLLIN, NULL, K_PORT);
		} else {
			/* The host is disconnected and the port polls as POLLHUP all the time:
			 * look again in 100 ms instead of spinning. */
			timeout = 100;
			port_gone = 0;
		}
		for (struct proc *p = procs; p; p = p->next) {
			if (p->out >= 0)
				ADD(p->out, POLLIN, p, K_OUT);
			if (p->err >= 0)
				ADD(p->err, POLLIN, p, K_ERR);
			if (p->in >= 0 && p->qoff < p->qlen)
				ADD(p->in, POLLOUT, p, K_IN);
		}
#undef ADD
		if (reads)
			timeout = 0; /* a READ is streaming: keep going */
		if (poll(pfd, n, timeout) < 0) {
			if (errno != EINTR)
				logmsg("poll: %s", strerror(errno));
			continue;
		}
		if (pfd[0].revents)
			reap();
		/* Procs are only freed below, so slot pointers stay valid; a slot whose fd was
		 * closed meanwhile no longer matches and is skipped. */
		for (size_t i = 0; i < n; i++) {
			struct proc *p = slot[i].p;
			if (!pfd[i].revents || !p)
				continue;
			if (slot[i].kind == K_OUT && p->out == pfd[i].fd)
				pump(p, &p->out, R_STDOUT);
			else if (slot[i].kind == K_ERR && p->err == pfd[i].fd)
				pump(p, &p->err, R_STDERR);
			else if (slot[i].kind == K_IN && p->in == pfd[i].fd)
				stdin_flush(p);
		}
		if (listen_fd >= 0 && port_slot >= 0 && pfd[port_slot].revents && gen == conn_gen) {
			/* (a write above may have lost or replaced the connection: then skip) */
			if (port_fd < 0)
				accept_host();
			else if (!(pfd[port_slot].revents & POLLIN) || !port_input())
				host_gone();
		} else if (listen_fd < 0 && port_slot >= 0 && pfd[port_slot].revents) {
			if (pfd[port_slot].revents & POLLIN)
				port_gone = !port_input();
			else /* POLLHUP alone: no host connected */
				port_gone = 1;
		}
		step_reads();
		for (struct proc **pp = &procs, *p; (p = *pp);) {
			if (p->done) {
				*pp = p->next;
				free(p);
			} else {
				pp = &p->next;
			}
		}
	}
}
